"""Match driver: run pattern families over a (canonicalized) GraphModule and collect :class:`Match` es.

A pattern family is a function ``find(gm) -> list[Match]`` registered under a name with
:func:`register`. :func:`find_matches` runs the requested families (default: all registered; the
families in ``patterns/`` register themselves on import) and drops matches that overlap a match
found earlier, so the result is conflict-free in the order given. Families expect the canonical
form produced by :func:`autofuse.canonicalize.canonicalize`; node names in a Match refer to the
GraphModule that was searched.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch.fx as fx

_FAMILIES: dict[str, Callable[[fx.GraphModule], list["Match"]]] = {}
_BUILTIN = ("patterns.attention", "patterns.moe", "patterns.mc2", "patterns.softmax", "patterns.vector_chain")


@dataclass(frozen=True)
class Match:
    """One fusible subgraph.

    pattern: family name ("attention").
    nodes:   fx node names the rewrite erases (the anchor included).
    anchor:  name of the node whose uses are replaced by the fused op's first output.
    inputs:  role -> fx node name of the values fed to the fused op (e.g. "q", "k", "v", "mask"), or a
             constant the rewrite builds (``"const:tril:Sq:Skv"``: a causal keep-mask).
    params:  kernel parameters and facts for planning (shapes, dtype, ...); family-specific.
    outputs: role -> fx node name whose value the fused op's output of that role replaces (the first is
             the anchor); default ``{"out": anchor}``.

    Names refer to the graph that was searched (the canonical view); :mod:`autofuse.rewrite` maps them
    onto the captured graph through each canonical node's ``meta["autofuse_origin"]``.
    """

    pattern: str
    nodes: tuple[str, ...]
    anchor: str
    inputs: dict = field(default_factory=dict, hash=False)
    params: dict = field(default_factory=dict, hash=False)
    outputs: dict = field(default_factory=dict, hash=False)

    def __post_init__(self):
        if not self.outputs:
            object.__setattr__(self, "outputs", {"out": self.anchor})


def register(name: str):
    """Decorator: register ``find(gm) -> list[Match]`` as pattern family ``name``."""
    def deco(fn):
        _FAMILIES[name] = fn
        return fn
    return deco


def families() -> dict:
    for mod in _BUILTIN:
        importlib.import_module(mod)
    return dict(_FAMILIES)


def find_matches(gm: fx.GraphModule, patterns=None) -> list[Match]:
    """All non-overlapping matches of the named families (default: every registered family)."""
    fams = families()
    names = list(fams) if patterns is None else list(patterns)
    out, taken = [], set()
    for name in names:
        for m in fams[name](gm):
            if taken.isdisjoint(m.nodes):
                out.append(m)
                taken.update(m.nodes)
    return out
