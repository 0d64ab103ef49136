"""MC2 families: a matmul and the collective it feeds or is fed by (tensor parallelism), as three templates.

``_c10d_functional`` collectives are asynchronous: their result is read through ``wait_tensor``. In the
canonical view a linear layer is ``aten.linear(x, W)`` or ``aten.matmul(x, transpose(W, -2, -1))`` (``x @ W.T``,
``mm(x, W.t())``), or ``aten.matmul(x, W)`` with the weight stored ``[K, N]``:

==========================  =============================================================================
``matmul_all_reduce``       ``y = x @ W`` → ``all_reduce(y, "sum", group)`` → ``wait_tensor``   (row-parallel)
``matmul_reduce_scatter``   ``y = x @ W`` → ``reduce_scatter_tensor(y, "sum", p, group)`` → ``wait_tensor``
``all_gather_matmul``       ``all_gather_into_tensor(x, p, group)`` → ``wait_tensor`` → ``· @ W``  (sequence-parallel)
==========================  =============================================================================

One builder (:func:`_template`) declares the three: a matmul node, a collective node and its wait, in the
order the data flows. The constraints (:func:`_decide`) read the matmul's operands and the collective's
arguments. A pair is *found* whenever the chain is there; ``params["unsupported"]`` names what keeps it from
fusing, so the planner rejects it with that reason (code ``unsupported``): a reduction other than sum, a bias
added before the reduction, the matmul's output read outside the pair, a weight that is not 2-D, operands
that are not float16/bfloat16/float32 of one dtype, rows that do not split over the ranks, a process group
that cannot be resolved. A gather along another dim is no match (torch spells it as ``all_gather_into_tensor``
along dim 0 followed by ``split``/``cat``, so no matmul reads the wait).

Match: ``nodes`` the matmul, the collective and its wait; ``inputs`` ``{"x", "weight"}``; ``outputs``
``{"out": ...}`` (plus ``"gathered"``, the gathered x, when an all-gather's result is read elsewhere too);
``params`` the kind, the group's name and size, the shapes, dtype and weight layout (``"nk"``: a linear's
``[N, K]``; ``"kn"``: ``[K, N]``), and ``backward``: the collective's gradient in the model as the user wrote it,
which the fused op's backward must compute (:func:`collective_backward`).

**Backward by spelling** (torch 2.13, measured against eager autograd; tests/test_distributed.py). The
``_c10d_functional`` ops are autograd-aware: ``all_reduce``'s backward all-reduces the gradient,
``all_gather_into_tensor``'s reduce-scatters it, ``reduce_scatter_tensor``'s all-gathers it. An in-place
``torch.distributed.all_reduce(t)`` captures as the same functional ``all_reduce`` (its value copied back into
``t``), but eager autograd passes the gradient through c10d's op unchanged (no autograd kernel: a warning,
identity): ``backward`` is ``"identity"`` there, ``"all_reduce"`` for the functional spelling. Both capture
routes say which: non-strict export records ``torch.distributed.all_reduce`` as the node's ``torch_fn``; Dynamo
remaps the call to ``_functional_collectives._remapped_allreduce``, which the node's stack trace names.

The canonical view merges identical pure nodes (CSE), and ``_c10d_functional`` collectives are pure to torch:
two all-reduces of one tensor over one group are one node of the view. The captured graph keeps both; a
match is carried over to the captured pair through its wait's origin, and the other stays unfused.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autofuse.graph import is_call, shape, val
from autofuse.match import Match, register
from autofuse.groups import group_size
from patterns.template import Template, graph_view

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
WAIT = c10d.wait_tensor.default
MATMULS = (aten.linear.default, aten.matmul.default, aten.mm.default)
COLLECTIVE = {"matmul_all_reduce": c10d.all_reduce.default,
              "matmul_reduce_scatter": c10d.reduce_scatter_tensor.default,
              "all_gather_matmul": c10d.all_gather_into_tensor.default}
KINDS = tuple(COLLECTIVE)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _template(kind: str) -> Template:
    """``mm → coll → wait`` (the reductions) or ``coll → wait → mm`` (the gather), anchored at the collective."""
    t = (Template(kind, anchor="coll").node("coll", COLLECTIVE[kind]).node("wait", WAIT)
         .node("mm", *MATMULS).edge("coll", "wait", 0))
    return t.edge("wait", "mm", 0) if kind == "all_gather_matmul" else t.edge("mm", "coll", 0)


TEMPLATES = {kind: _template(kind) for kind in KINDS}


def linear_operands(mm: fx.Node):
    """``(x, weight, layout, bias, why)`` of a matmul node: ``layout`` "nk" (a linear's ``[N, K]`` weight, read
    transposed) or "kn"; ``why`` says why it is not a linear with a 2-D weight (else "")."""
    x, b = mm.args[0], mm.args[1]
    bias = mm.args[2] if mm.target == aten.linear.default and len(mm.args) > 2 else None
    if mm.target == aten.linear.default:
        w, layout = b, "nk"
    elif is_call(b, aten.transpose.int) and len(shape(b) or ()) == 2 and sorted(d % 2 for d in b.args[1:3]) == [0, 1]:
        w, layout = b.args[0], "nk"
    else:
        w, layout = b, "kn"
    ws = shape(w)
    if ws is None or len(ws) != 2:
        return x, w, layout, bias, f"weight of shape {list(ws) if ws else ws} is not 2-D (a batched matmul)"
    return x, w, layout, bias, ""


def _why_not(kind, x, w, bias, mm, coll, world, reduce_op) -> str:
    if reduce_op is not None and reduce_op != "sum":
        return f"reduction {reduce_op!r}: the MC2 kernels sum"
    if bias is not None:
        return "bias added before the reduction: the MC2 kernels reduce x @ W alone (add the bias after it)"
    if kind != "all_gather_matmul" and len(mm.users) > 1:
        return "the matmul's output is also read outside the collective"
    vx, vw = val(x), val(w)
    if vx is None or vw is None or vx.dtype not in FLOATS or vx.dtype != vw.dtype:
        return "operands are not float16, bfloat16 or float32 of one dtype"
    if vx.dim() < 2:
        return f"x of shape {list(vx.shape)} has no rows"
    if world is None:
        return (f"process group {coll.args[-1]!r} cannot be resolved: plan on every rank with torch.distributed "
                f"initialised")
    if kind == "matmul_reduce_scatter" and vx.shape[0] % world:
        return f"dim 0 of x {list(vx.shape)} does not split over {world} ranks"
    return ""


#: the collective's own backward (the functional collectives' autograd), by kind
FUNCTIONAL_BACKWARD = {"matmul_all_reduce": "all_reduce", "matmul_reduce_scatter": "all_gather",
                       "all_gather_matmul": "reduce_scatter"}


def c10d_inplace_all_reduce(coll: fx.Node) -> bool:
    """Whether ``coll`` (a ``_c10d_functional.all_reduce``) is an in-place ``torch.distributed.all_reduce(t)``
    as a capture route remapped it (the module docstring)."""
    fn = coll.meta.get("torch_fn")
    stack = coll.meta.get("stack_trace") or ""
    return (bool(fn) and fn[1] == "function.all_reduce") or "in _remapped_allreduce" in stack


def collective_backward(kind: str, coll: fx.Node) -> str:
    """The gradient the pair's collective gets in eager autograd: ``"identity"`` for an in-place c10d
    all-reduce, else the functional collective's own (``FUNCTIONAL_BACKWARD``)."""
    if kind == "matmul_all_reduce" and c10d_inplace_all_reduce(coll):
        return "identity"
    return FUNCTIONAL_BACKWARD[kind]


def _decide(kind: str):
    def decide(m: dict) -> Match | None:
        mm, coll, wait = m["mm"], m["coll"], m["wait"]
        if list(coll.users) != [wait]:
            return None                    # the collective's result is read without (or besides) its wait
        x, w, layout, bias, why = linear_operands(mm)
        gather = kind == "all_gather_matmul"
        if gather:
            if mm.args[0] is not wait:
                return None
            x, world, reduce_op = coll.args[0], int(coll.args[1]), None
        else:
            if coll.args[0] is not mm:
                return None
            reduce_op = coll.args[1]
            world = int(coll.args[2]) if kind == "matmul_reduce_scatter" else group_size(coll.args[2])
        why = why or _why_not(kind, x, w, bias, mm, coll, world, reduce_op)
        out = mm if gather else wait
        outputs = {"out": out.name}
        if gather and any(u is not mm for u in wait.users):
            outputs["gathered"] = wait.name
        vx = val(x)
        params = {"kind": kind, "group_name": coll.args[-1], "world_size": world, "x_shape": shape(x),
                  "w_shape": shape(w), "weight_layout": layout, "backward": collective_backward(kind, coll),
                  "dtype": str(vx.dtype).replace("torch.", "") if vx is not None else None, "unsupported": why,
                  "out_like": val(out), "gathered_like": val(wait) if gather else None}
        nodes = tuple(n.name for n in (coll, wait, mm)) if gather else tuple(n.name for n in (mm, coll, wait))
        return Match(kind, nodes, out.name, {"x": x.name, "weight": w.name}, params, outputs)
    decide.__name__ = f"decide_{kind}"
    return decide


def _finder(kind: str):
    def find(gm: fx.GraphModule) -> list[Match]:
        return TEMPLATES[kind].match(graph_view(gm), _decide(kind))
    find.__name__ = f"find_{kind}"
    find.__doc__ = f"Every ``{kind}`` pair of ``gm`` (see the module docstring)."
    return find


for _kind in KINDS:
    register(_kind)(_finder(_kind))


def find_mc2(gm: fx.GraphModule) -> list[Match]:
    """Every matmul + collective pair of ``gm``, in graph order (the three families together)."""
    view = graph_view(gm)
    found = [m for kind in KINDS for m in _finder(kind)(gm)]
    return sorted(found, key=lambda m: view.order[m.anchor])


__all__ = ["FUNCTIONAL_BACKWARD", "KINDS", "TEMPLATES", "c10d_inplace_all_reduce", "collective_backward", "find_mc2",
           "linear_operands"]
