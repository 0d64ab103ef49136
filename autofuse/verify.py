"""Verify a fusion before applying it: the fused kernel must reproduce the unfused subgraph.

For a candidate the verifier

1. cuts the matched nodes out of the graph into a small GraphModule whose placeholders are the values
   flowing in (q, k, v, masks, and anything else the block reads);
2. obtains those values: from the example inputs, by running the full graph once in an interpreter, or,
   when the model was captured on meta tensors, as random tensors of the recorded shapes (bool masks
   random with every row keeping its first key, so no row is empty);
3. runs the block eagerly in its own dtype and in float64 (casts inside the block are kept at float64),
   and runs the rewritten block (the fused op) on the same values;
4. accepts when ``|fused − ref64| ≤ 2·|eager − ref64| + floor(dtype)`` elementwise-max, i.e. the fused
   kernel is at most twice as far from the exact answer as eager PyTorch is (plus one rounding of the
   output dtype as a floor, so an exact eager result does not demand an exact fused one).

Identical blocks (same shapes, dtypes, parameters, structure) are verified once.
"""
from __future__ import annotations

import functools
import hashlib

import torch
import torch.fx as fx

from autofuse.graph import val

FLOOR = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float64: 1e-12}


def extract(gm: fx.GraphModule, names, outputs) -> tuple[fx.GraphModule, list[fx.Node]]:
    """A GraphModule computing ``outputs`` from the nodes ``names``; returns it and the outside inputs."""
    nodes = {n.name: n for n in gm.graph.nodes}
    inside = {nodes[n] for n in names}
    g = fx.Graph()
    env, external = {}, []
    for n in gm.graph.nodes:
        if n not in inside:
            continue
        for a in n.all_input_nodes:
            if a not in inside and a not in env:
                if a.op == "get_attr":
                    env[a] = g.get_attr(a.target)
                else:
                    env[a] = g.placeholder(a.name)
                    env[a].meta = dict(a.meta)
                    external.append(a)
        env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[nodes[o]] for o in outputs))
    sub = fx.GraphModule(gm, g)
    return sub, external


def _constant_key(t) -> tuple:
    if not isinstance(t, torch.Tensor):
        return ("value", repr(t))
    if t.device.type == "meta" or t.numel() > (1 << 22):
        return ("tensor", tuple(t.shape), t.dtype, id(t))
    data = t.detach().contiguous().reshape(-1)
    return ("tensor", tuple(t.shape), t.dtype, hashlib.sha1(data.view(torch.uint8).numpy().tobytes()).hexdigest())


def structure_key(sub: fx.GraphModule) -> tuple:
    """A key equal for two blocks exactly when they compute the same function of same-shaped inputs:
    the ops in order, their arguments (nodes by position, not by name), every value's shape and dtype,
    and the contents of the constants the block reads. Node names, which differ from layer to layer,
    are left out."""
    index, parts = {}, []
    for i, n in enumerate(sub.graph.nodes):
        index[n] = i
        v = n.meta.get("val")
        vkey = (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None
        if n.op == "get_attr":
            target = _constant_key(functools.reduce(getattr, n.target.split("."), sub))
        else:
            target = n.target if n.op != "placeholder" else None
        args = fx.map_arg((n.args, n.kwargs), lambda a: ("%node", index[a]))
        parts.append((n.op, str(target), repr(args), vkey))
    return tuple(parts)


def random_like(node: fx.Node, gen: torch.Generator) -> torch.Tensor:
    v = val(node)
    if v.dtype == torch.bool:
        t = torch.rand(v.shape, generator=gen) < 0.7
        if t.dim() >= 1 and t.shape[-1] > 0:
            t[..., 0] = True
        return t
    if v.dtype.is_floating_point:
        return torch.randn(v.shape, generator=gen).to(v.dtype)
    return torch.randint(0, 2, v.shape, generator=gen).to(v.dtype)


class _F64(fx.Interpreter):
    """Runs a block in float64: float inputs promoted, float casts inside the block kept at float64."""

    def call_function(self, target, args, kwargs):
        if target is torch.ops.aten._to_copy.default and kwargs.get("dtype") in (torch.float16, torch.bfloat16,
                                                                                 torch.float32):
            kwargs = {**kwargs, "dtype": torch.float64}
        return super().call_function(target, args, kwargs)


def _f64(x):
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def check(sub: fx.GraphModule, fused_sub: fx.GraphModule, inputs: list) -> tuple[bool, float, float]:
    """(ok, error, tolerance) of the fused block against eager and float64 on ``inputs``."""
    with torch.no_grad():
        eager = sub(*inputs)
        ref = _F64(sub).run(*[_f64(x) for x in inputs])
        fused = fused_sub(*inputs)
    worst_err, worst_tol, ok = 0.0, 0.0, True
    for e, r, f in zip(eager, ref, fused):
        r = r.double()
        finite = torch.isfinite(r)
        if not torch.equal(finite, torch.isfinite(f.double())):
            return False, float("inf"), 0.0
        err_f = (f.double() - r)[finite].abs().max().item() if finite.any() else 0.0
        err_e = (e.double() - r)[finite].abs().max().item() if finite.any() else 0.0
        tol = 2 * err_e + FLOOR.get(e.dtype, 1e-6) * max(1.0, r[finite].abs().max().item() if finite.any() else 1)
        ok = ok and err_f <= tol
        worst_err, worst_tol = max(worst_err, err_f), max(worst_tol, tol)
    return ok, worst_err, worst_tol
