"""Peak activation memory of an fx graph, from tensor metadata (no data needed).

A tensor is live from the node that makes it to its last user; a view (reshape of a contiguous tensor,
transpose, slicing, getitem, ...) shares its base's storage and extends the base's life instead of adding
bytes. Parameters, buffers and graph inputs are not activations and are not counted. The peak is taken
over the program points of the graph's order; a node's transient memory (a fused kernel's workspace)
counts at that node only.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autofuse.lower import lower


def _bytes(v) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (tuple, list)):
        return sum(_bytes(x) for x in v)
    return 0


def peak_bytes(gm: fx.GraphModule, transient=None) -> int:
    """Peak bytes live at once. ``transient(node) -> bytes``: memory a node holds only while it runs (a
    fused kernel's GM workspace), counted on top of what is live at that node."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    base = {}
    for n in nodes:
        if n.op == "call_function" and lower(n).free and n.all_input_nodes:
            src = n.all_input_nodes[0]
            base[n] = base.get(src, src)
        else:
            base[n] = n
    last = {}
    for n in nodes:
        for a in n.all_input_nodes:
            b = base[a]
            last[b] = max(last.get(b, order[b]), order[n])
    def nbytes(n):
        if "val" in n.meta:
            return _bytes(n.meta["val"])
        return sum(_bytes(u.meta.get("val")) for u in n.users)      # a multi-output op: its getitems know
    size = {n: nbytes(n) for n in nodes if n.op == "call_function" and base[n] is n}
    frees = {}
    for n, s in size.items():
        frees.setdefault(last.get(n, order[n]), []).append(s)
    live = peak = 0
    for i, n in enumerate(nodes):
        live += size.get(n, 0)
        peak = max(peak, live + (transient(n) if transient is not None else 0))
        live -= sum(frees.get(i, ()))
    return peak
