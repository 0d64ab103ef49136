"""MC2 fused ops (a matmul fused with its collective) as ``torch.library`` custom ops.

    y = torch.ops.autofuse.matmul_all_reduce(x, weight, "sum", group_name, 4, "ascend910b")
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

Backward (recomputed on the host in fp32 from the saved inputs, not simulated), with dy the output gradient:

* ``matmul_all_reduce``: y = Σ_ranks x_r W_rᵀ is replicated, so dy is the same on every rank and the
  all-reduce's backward is the identity (Megatron's "g"): dx = dy W, dW = dyᵀ x — no communication.
  (torch's own ``_functional_collectives.all_reduce`` differentiates differently in torch 2.13: it
  all-reduces the gradient, which for a replicated dy gives p times this; measured, not assumed.)
* ``matmul_reduce_scatter``: y = rows r of Σ x Wᵀ; its backward all-gathers dy: dx = AG(dy) W,
  dW = AG(dy)ᵀ x.
* ``all_gather_matmul``: y = AG(x) Wᵀ; dW = dyᵀ AG(x) (AG(x) is the op's second output, saved), and
  dx = reduce_scatter(dy W) (each rank's rows of the sum over ranks).
"""
from __future__ import annotations

import json

import torch

from autofuse.ops import _record, _to_torch, run_kernel

_REDUCE_OPS = ("sum",)


def _comm(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group
    from autofuse.npu.link import GlooComm
    return GlooComm(_resolve_process_group(group_name))


def _tiling(tiling: str):
    return json.loads(tiling) if tiling else None


def _check(name, x, weight, reduce_op=None):
    if reduce_op is not None and reduce_op not in _REDUCE_OPS:
        raise ValueError(f"{name}: reduce_op {reduce_op!r} is not supported (only 'sum')")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{name}: x {list(x.shape)} @ weight.T with weight {list(weight.shape)} is not a linear")


@torch.library.custom_op("autofuse::matmul_all_reduce", mutates_args=())
def matmul_all_reduce(x: torch.Tensor, weight: torch.Tensor, reduce_op: str, group_name: str, tiles: int = 4,
                      device: str = "ascend910b", tiling: str = "",
                      algorithm: str = "") -> torch.Tensor:
    _check("matmul_all_reduce", x, weight, reduce_op)
    r = run_kernel("matmul_all_reduce", x, weight.detach().t().contiguous(), comm=_comm(group_name), tiles=tiles,
                   device=device, tiling=_tiling(tiling), algorithm=algorithm or None)
    _record("matmul_all_reduce", r.stats)
    return _to_torch(r.outputs[0], x.dtype)


@matmul_all_reduce.register_fake
def _(x, weight, reduce_op, group_name, tiles=4, device="ascend910b", tiling="", algorithm=""):
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


# ------------------------------------------------------------------------------------------ backward
def _fc():
    import torch.distributed._functional_collectives as fc
    return fc


def _grads(ctx, dy_full, x):
    """dx = dy W, dW = dyᵀ x (fp32 on the host), shaped and typed like x and W."""
    w = ctx.saved_tensors[1]
    dyf = dy_full.float().reshape(-1, dy_full.shape[-1])
    xf = x.float().reshape(-1, x.shape[-1])
    dx = (dyf @ w.float()).reshape(*x.shape[:-1], w.shape[1]).to(x.dtype) if ctx.needs_input_grad[0] else None
    dw = (dyf.t() @ xf).to(w.dtype) if ctx.needs_input_grad[1] else None
    return dx, dw


def _save(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.group_name = inputs[3] if len(inputs) > 3 and isinstance(inputs[3], str) else inputs[2]


def _backward_mar(ctx, dy):
    dx, dw = _grads(ctx, dy, ctx.saved_tensors[0])
    return dx, dw, None, None, None, None, None, None


def _backward_mrs(ctx, dy):
    fc = _fc()
    full = fc.wait_tensor(fc.all_gather_tensor(dy.contiguous(), 0, ctx.group_name))
    dx, dw = _grads(ctx, full, ctx.saved_tensors[0])
    return dx, dw, None, None, None, None, None, None, None


def _save_agm(ctx, inputs, output):
    ctx.save_for_backward(output[1], inputs[1])
    ctx.group_name = inputs[2]
    ctx.x_shape, ctx.x_dtype = inputs[0].shape, inputs[0].dtype


def _backward_agm(ctx, dy, dgathered):
    fc = _fc()
    gathered = ctx.saved_tensors[0]
    w = ctx.saved_tensors[1]
    dyf = dy.float().reshape(-1, dy.shape[-1])
    dw = (dyf.t() @ gathered.float().reshape(-1, gathered.shape[-1])).to(w.dtype) if ctx.needs_input_grad[1] else None
    dx = None
    if ctx.needs_input_grad[0]:
        dfull = (dyf @ w.float()).reshape(*gathered.shape)
        if dgathered is not None:
            dfull = dfull + dgathered.float()
        dx = fc.wait_tensor(fc.reduce_scatter_tensor(dfull.contiguous(), "sum", 0, ctx.group_name))
        dx = dx.reshape(ctx.x_shape).to(ctx.x_dtype)
    return dx, dw, None, None, None, None, None, None


matmul_all_reduce.register_autograd(_backward_mar, setup_context=_save)
matmul_reduce_scatter.register_autograd(_backward_mrs, setup_context=_save)
all_gather_matmul.register_autograd(_backward_agm, setup_context=_save_agm)


__all__ = ["all_gather_matmul", "matmul_all_reduce", "matmul_reduce_scatter"]
