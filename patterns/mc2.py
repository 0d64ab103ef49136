"""MC2 pairs: a matmul and the collective it feeds or is fed by, in a captured aten graph.

Three shapes, each read as a short chain of fx nodes (``_c10d_functional`` collectives are asynchronous:
their result is used through ``wait_tensor``):

==========================  =============================================================================
``matmul_all_reduce``       ``y = linear(x, W)`` → ``all_reduce(y, "sum", group)`` → ``wait_tensor``
``matmul_reduce_scatter``   ``y = linear(x, W)`` → ``reduce_scatter_tensor(y, "sum", p, group)`` → ``wait``
``all_gather_matmul``       ``all_gather_into_tensor(x, p, group)`` → ``wait`` → ``linear(·, W)``
==========================  =============================================================================

``linear(x, W)`` is ``aten.linear(x, W)`` or ``aten.mm/matmul(x, aten.t(W))`` with a 2-D weight. A pair is
*found* when the chain is there; its ``params["unsupported"]`` names what keeps it from fusing (a reduction
other than sum, a bias added before the reduction, a matmul output used elsewhere, an all-gather along
another dim, a weight that is not 2-D) so the planner can reject it with that reason.

:func:`find_mc2` returns :class:`autofuse.match.Match` es: ``nodes`` the covered nodes, ``anchor`` the node
whose uses the fused op's output takes, ``inputs`` ``{"x", "weight"}``, ``params`` the kernel kind, group,
world size, shapes and dtype.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autofuse.graph import arg, is_call, shape, val
from autofuse.match import Match

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
WAIT = c10d.wait_tensor.default
_LINEAR = (aten.linear.default,)
_MM = (aten.mm.default, aten.matmul.default)


def _linear(n: fx.Node):
    """``(x, weight, bias)`` if ``n`` computes ``x @ weight.T (+ bias)`` with a 2-D weight, else None."""
    if is_call(n, *_LINEAR):
        w = n.args[1]
        return n.args[0], w, arg(n, 2, "bias")
    if is_call(n, *_MM) and is_call(n.args[1], aten.t.default, aten.transpose.int):
        t = n.args[1]
        if is_call(t, aten.transpose.int) and sorted(d % 2 for d in t.args[1:3]) != [0, 1]:
            return None
        return n.args[0], t.args[0], None
    return None


def _wait_of(n: fx.Node):
    users = list(n.users)
    return users[0] if len(users) == 1 and is_call(users[0], WAIT) else None


def _why_not(x, w, bias, y_users, reduce_op=None):
    if reduce_op is not None and reduce_op != "sum":
        return f"reduction {reduce_op!r}: the MC2 kernels sum"
    if bias is not None:
        return "bias added before the reduction (fuse the linear without bias and add it after the collective)"
    if y_users is not None and y_users > 1:
        return "the matmul's output is also used outside the collective"
    ws = shape(w)
    if ws is None or len(ws) != 2:
        return f"weight of shape {ws} is not 2-D"
    if val(x) is None or val(x).dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return "operands are not float16, bfloat16 or float32"
    return None


def _params(kind, x, w, group, world, unsupported):
    return {"kind": kind, "group_name": group, "world_size": world, "x_shape": shape(x), "w_shape": shape(w),
            "dtype": str(val(x).dtype).replace("torch.", "") if val(x) is not None else None,
            "unsupported": unsupported}


def find_mc2(gm: fx.GraphModule) -> list[Match]:
    """Every matmul + collective pair of ``gm`` (see the module docstring), in graph order."""
    out = []
    for n in gm.graph.nodes:
        if is_call(n, c10d.all_reduce.default, c10d.reduce_scatter_tensor.default):
            wait = _wait_of(n)
            lin = _linear(n.args[0]) if isinstance(n.args[0], fx.Node) else None
            if wait is None or lin is None:
                continue
            mm = n.args[0]
            x, w, bias = lin
            ar = n.target == c10d.all_reduce.default
            reduce_op = n.args[1]
            world = None if ar else n.args[2]
            group = n.args[2] if ar else n.args[3]
            why = _why_not(x, w, bias, len(mm.users), reduce_op)
            nodes = [mm.name, n.name, wait.name]
            if is_call(mm, *_MM):
                nodes.insert(0, mm.args[1].name)
            kind = "matmul_all_reduce" if ar else "matmul_reduce_scatter"
            out.append(Match(kind, tuple(nodes), wait.name, {"x": x.name, "weight": w.name},
                             _params(kind, x, w, group, world, why)))
        elif is_call(n, c10d.all_gather_into_tensor.default):
            wait = _wait_of(n)
            if wait is None:
                continue
            for user in list(wait.users):
                lin = _linear(user)
                if lin is None or lin[0] is not wait:
                    continue
                x, w, bias = n.args[0], lin[1], lin[2]
                why = _why_not(x, w, bias, None)
                nodes = [n.name, wait.name, user.name]
                if is_call(user, *_MM):
                    nodes.append(user.args[1].name)
                out.append(Match("all_gather_matmul", tuple(nodes), user.name, {"x": x.name, "weight": w.name},
                                 _params("all_gather_matmul", x, w, n.args[2], n.args[1], why)))
                break
    return out


__all__ = ["find_mc2"]
