"""MC2 fused ops (a matmul fused with its collective) as ``torch.library`` custom ops.

    y = torch.ops.autofuse.matmul_all_reduce(x, weight, "sum", group_name, 4, "ascend910b")   # backward="all_reduce"
    y = torch.ops.autofuse.matmul_reduce_scatter(x, weight, "sum", group_name, world_size, 4, "ascend910b")
    y, x_all = torch.ops.autofuse.all_gather_matmul(x, weight, group_name, world_size, 4, "ascend910b")

``weight`` is a linear layer's weight ``[N, K]`` (``y = x @ weight.T``); the kernel reads it laid out as
``[K, N]`` (weights are laid out once, as the Cube's NZ format is). ``group_name`` names the process group as
the functional collectives (``torch.distributed._functional_collectives``) do; the op runs the MC2 kernel on
this rank's simulated NPU, exchanging real data with the other ranks through that group (gloo), and records
the launch for whole-graph simulation. ``tiles``: the tiles the kernel pipelines (row or column tiles, see
``autofuse/npu/kernels/mc2.py``); ``tiling``: the matmul's tiling as JSON (``""``: the kernel's own);
``algorithm``: the tiles' collective algorithm (``""``: the one a collective library picks for each tile's
size). The cost model's :func:`cost_model.mc2.choose_tiles` picks all three. Only ``"sum"`` reductions.

Backward: simulated launches, the duals of the forwards (Megatron's sequence parallelism), with dy the output
gradient. The dual MC2 op runs its kernel on this rank's simulated NPU through the same process group, with the
forward's tile count (it pipelines the same rows) and its own default tiling and algorithm; it takes Wᵀ as its
linear weight, so its kernel's right operand is W itself, ``[N, K]`` as stored (the dual's inner dim is N). The
local GEMMs run the Cube ``matmul`` kernel through ``torch.ops.autofuse.matmul(a, b, trans_a, trans_b, device)``
(2-D, fp32 accumulation, rounded once; its fake and ``reference_matmul`` twin are here). In a traced training
step (:mod:`autofuse.training`) they are nodes of the joint graph like any fused call.

* ``matmul_all_reduce``: y = Σ_ranks x_r W_rᵀ. Its backward is the backward of the spelling it replaces, named
  by ``backward``. ``"all_reduce"`` (the default; ``_functional_collectives.all_reduce``, whose autograd in torch
  2.13 all-reduces the gradient): g = AR(dy), a functional all-reduce of dy (the same collective launch the
  unfused graph's backward runs), then dx = g W and dW = gᵀ x, two ``matmul`` launches. ``"identity"``
  (``torch.distributed.all_reduce(t)`` in place: c10d's op has no autograd kernel, and eager autograd passes the
  gradient through it unchanged, with a warning; Megatron's "g"): dx = dy W and dW = dyᵀ x, no communication.
  For a replicated dy (the same loss on every rank) the first is p times the second.
* ``matmul_reduce_scatter``: y = rows r of Σ x Wᵀ; its backward all-gathers dy: dx = AG(dy) W is
  ``all_gather_matmul(dy, Wᵀ)`` (one MC2 launch), whose second output AG(dy) gives dW = AG(dy)ᵀ x (a ``matmul``
  launch with a transposed). When only W wants a gradient, AG(dy) is a plain functional all-gather.
* ``all_gather_matmul``: y = AG(x) Wᵀ; dx = reduce_scatter(dy W) is ``matmul_reduce_scatter(dy, Wᵀ)`` (one MC2
  launch) and dW = dyᵀ AG(x) a ``matmul`` launch on the saved second output. A gradient of that second output
  (``dgathered``, when the graph reads AG(x)) belongs in the reduce-scatter's sum, dx = RS(dy W + dgathered);
  the fused kernel takes no addend, so, the reduce-scatter being linear, dgathered is reduce-scattered on its
  own (a functional collective, in fp32) and added in fp32 to the MC2 launch's dx (itself rounded to x's
  dtype, as eager's dy W is), the sum rounded to x's dtype.

Outputs without a gradient get no launch (``set_materialize_grads(False)``).
"""
from __future__ import annotations

import json

import torch

from autofuse.grad_ops import no_double_backward
from autofuse.ops import REFERENCES, _record, _to_torch, run_kernel

_REDUCE_OPS = ("sum",)


def _comm(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group
    from autofuse.npu.link import GlooComm
    return GlooComm(_resolve_process_group(group_name))


#: matmul_all_reduce's backwards: the all-reduce's gradient as the spelling it replaces differentiates it
AR_BACKWARDS = ("all_reduce", "identity")


def _check_backward(backward: str):
    if backward not in AR_BACKWARDS:
        raise ValueError(f"matmul_all_reduce: backward {backward!r} is not one of {AR_BACKWARDS}")


def _tiling(tiling: str):
    return json.loads(tiling) if tiling else None


def _check(name, x, weight, reduce_op=None):
    if reduce_op is not None and reduce_op not in _REDUCE_OPS:
        raise ValueError(f"{name}: reduce_op {reduce_op!r} is not supported (only 'sum')")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{name}: x {list(x.shape)} @ weight.T with weight {list(weight.shape)} is not a linear")


@torch.library.custom_op("autofuse::matmul_all_reduce", mutates_args=())
def matmul_all_reduce(x: torch.Tensor, weight: torch.Tensor, reduce_op: str, group_name: str, tiles: int = 4,
                      device: str = "ascend910b", tiling: str = "", algorithm: str = "",
                      backward: str = "all_reduce") -> torch.Tensor:
    _check("matmul_all_reduce", x, weight, reduce_op)
    _check_backward(backward)
    r = run_kernel("matmul_all_reduce", x, weight.detach().t().contiguous(), comm=_comm(group_name), tiles=tiles,
                   device=device, tiling=_tiling(tiling), algorithm=algorithm or None)
    _record("matmul_all_reduce", r.stats)
    return _to_torch(r.outputs[0], x.dtype)


@matmul_all_reduce.register_fake
def _(x, weight, reduce_op, group_name, tiles=4, device="ascend910b", tiling="", algorithm="", backward="all_reduce"):
    _check_backward(backward)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("autofuse::matmul_reduce_scatter", mutates_args=())
def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, reduce_op: str, group_name: str,
                          world_size: int, tiles: int = 4, device: str = "ascend910b", tiling: str = "",
                          algorithm: str = "") -> torch.Tensor:
    _check("matmul_reduce_scatter", x, weight, reduce_op)
    r = run_kernel("matmul_reduce_scatter", x, weight.detach().t().contiguous(), comm=_comm(group_name),
                   tiles=tiles, device=device, tiling=_tiling(tiling), algorithm=algorithm or None)
    _record("matmul_reduce_scatter", r.stats)
    return _to_torch(r.outputs[0], x.dtype)


@matmul_reduce_scatter.register_fake
def _(x, weight, reduce_op, group_name, world_size, tiles=4, device="ascend910b", tiling="", algorithm=""):
    return x.new_empty((x.shape[0] // world_size, *x.shape[1:-1], weight.shape[0]))


@torch.library.custom_op("autofuse::all_gather_matmul", mutates_args=())
def all_gather_matmul(x: torch.Tensor, weight: torch.Tensor, group_name: str, world_size: int, tiles: int = 4,
                      device: str = "ascend910b", tiling: str = "",
                      algorithm: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    _check("all_gather_matmul", x, weight)
    r = run_kernel("all_gather_matmul", x, weight.detach().t().contiguous(), comm=_comm(group_name), tiles=tiles,
                   device=device, tiling=_tiling(tiling), algorithm=algorithm or None)
    _record("all_gather_matmul", r.stats)
    return _to_torch(r.outputs[0], x.dtype), _to_torch(r.outputs[1], x.dtype)


@all_gather_matmul.register_fake
def _(x, weight, group_name, world_size, tiles=4, device="ascend910b", tiling="", algorithm=""):
    lead = (x.shape[0] * world_size, *x.shape[1:-1])
    return x.new_empty((*lead, weight.shape[0])), x.new_empty((*lead, x.shape[-1]))


# ------------------------------------------------------------------------------------------ plain matmul
@torch.library.custom_op("autofuse::matmul", mutates_args=())
def matmul(a: torch.Tensor, b: torch.Tensor, trans_a: bool = False, trans_b: bool = False,
           device: str = "ascend910b", tiling: str = "") -> torch.Tensor:
    """``op(a) @ op(b)`` of 2-D operands (``op``: transposed when asked) on the simulator's Cube ``matmul``
    kernel: fp32 accumulation, the result rounded once to a's dtype. The MC2 backwards' local GEMMs."""
    _check_2d(a, b, trans_a, trans_b)
    r = run_kernel("matmul", a, b, trans_a=trans_a, trans_b=trans_b, device=device, tiling=_tiling(tiling))
    _record("matmul", r.stats)
    return _to_torch(r.outputs[0], a.dtype)


def _check_2d(a, b, trans_a, trans_b):
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"autofuse::matmul: a {list(a.shape)} and b {list(b.shape)} must be 2-D; flatten the "
                         f"leading dims first")
    if (a.shape[0] if trans_a else a.shape[1]) != (b.shape[1] if trans_b else b.shape[0]):
        raise ValueError(f"autofuse::matmul: inner dims of a {list(a.shape)} (trans_a={trans_a}) and b "
                         f"{list(b.shape)} (trans_b={trans_b}) differ")


@matmul.register_fake
def _(a, b, trans_a=False, trans_b=False, device="ascend910b", tiling=""):
    _check_2d(a, b, trans_a, trans_b)
    return a.new_empty((a.shape[1] if trans_a else a.shape[0], b.shape[0] if trans_b else b.shape[1]))


def reference_matmul(a, b, trans_a=False, trans_b=False, **_):
    """The kernel's numerics in torch: fp32 products and sums, rounded once to a's dtype (repeated launches)."""
    af, bf = a.float(), b.float()
    return ((af.t() if trans_a else af) @ (bf.t() if trans_b else bf)).to(a.dtype)


REFERENCES["matmul"] = reference_matmul


# ------------------------------------------------------------------------------------------ backward
def _rows(t):
    return t.reshape(-1, t.shape[-1])


def _dw(dy, x, device):
    """dW = dyᵀ x [N, K] (a linear's weight layout) from dy [..., N] and x [..., K]: one matmul launch."""
    return torch.ops.autofuse.matmul(_rows(dy).contiguous(), _rows(x).contiguous(), True, False, device)


def _save(ctx, inputs, output):
    """The forward's x, weight and the arguments the dual launches reuse (group, world size, tile count,
    device)."""
    x, weight, *rest = inputs
    params = dict(zip(_PARAMS[ctx.kind], rest))
    ctx.save_for_backward(x if ctx.kind != "all_gather_matmul" else output[1], weight)
    ctx.group_name, ctx.world = params["group_name"], params.get("world_size")     # matmul_all_reduce: none
    ctx.tiles, ctx.device = params["tiles"], params["device"]
    ctx.backward = params.get("backward")      # matmul_all_reduce: "all_reduce" or "identity"
    ctx.x_shape = x.shape


_PARAMS = {"matmul_all_reduce": ("reduce_op", "group_name", "tiles", "device", "tiling", "algorithm", "backward"),
           "matmul_reduce_scatter": ("reduce_op", "group_name", "world_size", "tiles", "device"),
           "all_gather_matmul": ("group_name", "world_size", "tiles", "device")}


def _setup(kind):
    def setup(ctx, inputs, output):
        ctx.kind = kind
        ctx.set_materialize_grads(False)   # an output the graph does not read has no gradient (no launch for it)
        _save(ctx, inputs, output)
    return setup


def _backward_mar(ctx, dy):
    """Row-parallel: g = AR(dy) (``backward="all_reduce"``, a functional all-reduce) or g = dy (``"identity"``),
    then dx = g W and dW = gᵀ x, two local matmul launches (the module docstring)."""
    x, w = ctx.saved_tensors
    dy = dy.contiguous()
    if ctx.backward == "all_reduce" and any(ctx.needs_input_grad[:2]):
        fc = _fc()
        dy = fc.wait_tensor(torch.ops._c10d_functional.all_reduce(dy, "sum", ctx.group_name))
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = torch.ops.autofuse.matmul(_rows(dy), w.contiguous(), False, False, ctx.device).reshape(ctx.x_shape)
    if ctx.needs_input_grad[1]:
        dw = _dw(dy, x, ctx.device)
    return (dx, dw) + (None,) * 7


def _backward_mrs(ctx, dy):
    """dx = AG(dy) W: the dual ``all_gather_matmul(dy, Wᵀ)``, whose second output AG(dy) gives dW = AG(dy)ᵀ x
    (a matmul launch). Without dx: a plain all-gather (a functional collective) for dW."""
    x, w = ctx.saved_tensors
    dy = dy.contiguous()
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx, gathered = torch.ops.autofuse.all_gather_matmul(dy, w.t(), ctx.group_name, ctx.world, ctx.tiles,
                                                            ctx.device)
        dx = dx.reshape(ctx.x_shape)
    elif ctx.needs_input_grad[1]:
        fc = _fc()
        gathered = fc.wait_tensor(fc.all_gather_single(dy, 0, ctx.group_name))
    if ctx.needs_input_grad[1]:
        dw = _dw(gathered, x, ctx.device)
    return (dx, dw) + (None,) * 7


def _backward_agm(ctx, dy, dgathered):
    """dx = RS(dy W): the dual ``matmul_reduce_scatter(dy, Wᵀ)``; dW = dyᵀ AG(x) from the saved second output
    (a matmul launch). A gradient of the gathered output (``dgathered``, when the graph reads it) adds to
    dy W before the reduce-scatter; the fused launch takes no addend, and the reduce-scatter is linear, so
    it is reduce-scattered on its own (a functional collective) and added in fp32 (the module docstring)."""
    gathered, w = ctx.saved_tensors
    dx = dw = None
    if ctx.needs_input_grad[0] and dy is not None:
        dx = torch.ops.autofuse.matmul_reduce_scatter(dy.contiguous(), w.t(), "sum", ctx.group_name, ctx.world,
                                                      ctx.tiles, ctx.device).reshape(ctx.x_shape)
    if ctx.needs_input_grad[0] and dgathered is not None:
        fc = _fc()
        extra = fc.wait_tensor(fc.reduce_scatter_single(dgathered.float().contiguous(), "sum", 0, ctx.group_name))
        extra = extra.reshape(ctx.x_shape)
        dx = (extra if dx is None else dx.float() + extra).to(gathered.dtype)
    if ctx.needs_input_grad[1]:
        dw = _dw(dy, gathered, ctx.device) if dy is not None else torch.zeros_like(w)
    return (dx, dw) + (None,) * 6


def _fc():
    import torch.distributed._functional_collectives as fc
    return fc


matmul_all_reduce.register_autograd(_backward_mar, setup_context=_setup("matmul_all_reduce"))
matmul_reduce_scatter.register_autograd(_backward_mrs, setup_context=_setup("matmul_reduce_scatter"))
all_gather_matmul.register_autograd(_backward_agm, setup_context=_setup("all_gather_matmul"))


__all__ = ["all_gather_matmul", "matmul", "matmul_all_reduce", "matmul_reduce_scatter", "reference_matmul"]


no_double_backward(matmul, "a fused matmul + collective (MC2)", "matmul_all_reduce", "all_gather_matmul",
                   "matmul_reduce_scatter")
