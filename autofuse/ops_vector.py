"""Generated Vector kernels as fused torch ops: ``torch.ops.autofuse.vector_program`` and ``matmul_epilogue``.

    outs = torch.ops.autofuse.vector_program(inputs, program_json, "ascend910", "")
    outs = torch.ops.autofuse.matmul_epilogue(a, b, bias, extra, program_json, False, "ascend910", "")
    outs = autofuse.ops_vector.vector_program(inputs, program)          # Program or JSON; tiling as a dict

``program`` is a :class:`cost_model.program.Program` as JSON (``Program.to_json()``); ``tiling`` a JSON object
(``""`` = the kernel's default). Each op's CPU implementation runs its simulator kernel and records the
launch (``autofuse.ops.recording``); its fake implementation gives the program's output shapes and dtypes;
its backward is a generated Vector kernel too: :func:`cost_model.program_grad.backward_program` derives the
backward program (it recomputes the forward values it needs from the saved inputs and accumulates the
adjoints in fp32), run as one more ``vector_program`` launch, plus a torch ``sum`` per input broadcast along
lead dims (a norm weight's gradient is the sum of every row's contribution: a separate reduction). A program
whose backward cannot be a Vector program (``NotDifferentiable``, or no tiling of it fits the device) falls
back to recomputing it in fp32 with the torch interpreter (``run_program_torch``) on the host and
differentiating that (not simulated, as for flash_attention). ``reference_vector_program`` and
``reference_matmul_epilogue`` are the torch twins with the kernels' numerics, for repeated launches.

matmul_epilogue: the program's input 0 is the product ``a @ b`` (``b`` transposed with ``trans_b``) plus
``bias``, in the dtype the program declares for it (float32: the accumulator; a's dtype: rounded as a
matmul's output is); ``extra`` are its inputs 1.. .
"""
from __future__ import annotations

import functools
import json
from typing import Optional

import torch

import cost_model
from cost_model.program import BIT, ProgramError, stored_shape
from cost_model.program_grad import NotDifferentiable, backward_program, reads_input
from autofuse import ops as _ops      # run_kernel through the module, so tests can inject a fault
from autofuse.graph import in_order
from autofuse.ops import REFERENCES, TIMING, _record, _to_torch
from autofuse.vector_program import as_program, run_program_torch, torch_dtype


def _tiling(tiling: str):
    return json.loads(tiling) if tiling else None


def _launch_vector_program(inputs, program, device, tiling, **kw):
    """``(program, Result)`` of one vector_program launch from the op's arguments (``timing_only=True``: shapes
    suffice)."""
    prog = as_program(program)
    return prog, _ops.run_kernel("vector_program", *inputs, program=prog, device=device, tiling=_tiling(tiling), **kw)


def _launch_matmul_epilogue(a, b, bias, extra, program, trans_b, device, tiling, **kw):
    """``(program, Result)`` of one matmul_epilogue launch from the op's arguments."""
    prog = as_program(program)
    return prog, _ops.run_kernel("matmul_epilogue", a, b, *extra, program=prog, bias=bias, trans_b=trans_b,
                                 device=device, tiling=_tiling(tiling), **kw)


def _outputs(prog, like):
    return [like.new_empty(shape, dtype=torch_dtype(o.dtype)) for o, shape in zip(prog.outputs, prog.output_shapes())]


def _grads(outs, grad_outs, leaves):
    """d(outs)/d(leaves) against the incoming gradients (outputs without one, or bool ones, are skipped)."""
    pairs = [(o, g) for o, g in zip(outs, grad_outs) if g is not None and o.is_floating_point() and o.requires_grad]
    wrt = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
    if not pairs or not wrt:
        return iter([None] * len(wrt))
    got = torch.autograd.grad([o for o, _ in pairs], wrt, [g.to(o.dtype) for o, g in pairs], allow_unused=True)
    return iter(got)


def _leaf(t, need):
    if t is None or not t.is_floating_point():
        return t
    return t.detach().float().requires_grad_(need)


# ------------------------------------------------------------------------------------------ vector_program
def _laid_out(outs, layouts: str) -> list:
    """Each output with its memory in the order ``layouts`` gives (JSON: per output, its dims from outermost to
    innermost, or null for row-major), as the captured value it replaces was laid out: later views of it rely on
    that (RoPE's rotated queries keep the [B, S, N, D] memory of the projection they came from, and an unfused
    SDPA's output follows its query's). The kernel stores each row to its place in that layout (a DMA store of
    the row to its address); the simulator charges a store by its bytes, so the layout does not change its cost."""
    if not layouts:
        return list(outs)
    return [in_order(t, order) for t, order in zip(outs, json.loads(layouts))]


@torch.library.custom_op("autofuse::vector_program", mutates_args=())
def _vector_program(inputs: list[torch.Tensor], program: str, device: str = "ascend910",
                    tiling: str = "", layouts: str = "") -> list[torch.Tensor]:
    prog, r = _launch_vector_program(inputs, program, device, tiling)
    _record("vector_program", r.stats)
    return _laid_out([_to_torch(o, torch_dtype(spec.dtype)) for o, spec in zip(r.outputs, prog.outputs)], layouts)


@_vector_program.register_fake
def _(inputs, program, device="ascend910", tiling="", layouts=""):
    return _laid_out(_outputs(as_program(program), inputs[0]), layouts)


def reference_vector_program(inputs, program, layouts="", **_):
    """What the kernel computes, in torch (the program's numerics: fp32 steps, rounding at casts and outputs)."""
    return _laid_out(run_program_torch(program, inputs), layouts)


def _vp_setup(ctx, inputs, output):
    ins, program = inputs[0], inputs[1]
    ctx.save_for_backward(*ins)
    ctx.program = program
    ctx.device = inputs[2] if len(inputs) > 2 else "ascend910"
    ctx.set_materialize_grads(False)     # an output nobody reads has no gradient: the backward loads none


@functools.lru_cache(maxsize=256)
def _grad_launch(program: str, wrt: tuple, outputs: tuple, device: str):
    """``(GradProgram, tiling JSON)`` of the backward of ``program`` for inputs ``wrt`` from the gradients of
    ``outputs``, the tiling the cost model's search picks for it on ``device``; None when the backward is no
    Vector program that fits (an instruction without a derivable gradient, or shuffles in rows too wide for
    UB)."""
    for split in (False, True):      # slice gradients as separate outputs when their cat needs too wide rows
        try:
            gp = backward_program(program, wrt, outputs, split=split)
            if gp.program is None:
                return gp, ""
            specs = [(stored_shape(i), "uint8") if i.dtype == BIT else (tuple(i.shape), i.dtype)
                     for i in gp.program.inputs]
            e = cost_model.estimate("vector_program", specs, device=device, program=gp.program)
        except NotDifferentiable:
            return None
        except ProgramError:
            continue
        return gp, json.dumps(e.tiling, sort_keys=True) if e.tiling else ""
    return None


def _given(grad_outs) -> tuple:
    return tuple(j for j, g in enumerate(grad_outs) if g is not None)


def run_grad_program(gp, tiling, ins, grad_outs, device) -> list:
    """The gradients of the inputs ``gp.grads`` names, from one ``vector_program`` launch of ``gp.program`` over
    the forward's inputs ``ins`` and its outputs' gradients ``grad_outs`` (None: zero), assembled by
    :func:`gradients_from`."""
    outs = []
    if gp.program is not None:
        nin = len(ins)
        gs = []
        for k, j in enumerate(gp.grad_of):
            spec = gp.program.inputs[nin + k]
            g = grad_outs[j]
            g = torch.zeros(spec.shape, dtype=torch_dtype(spec.dtype), device=ins[0].device) if g is None else \
                g.to(torch_dtype(spec.dtype)).reshape(spec.shape).contiguous()
            gs.append(g)
        outs = torch.ops.autofuse.vector_program(list(ins) + gs, gp.program.to_json(), device, tiling)
    return gradients_from(gp, outs, ins[0].device)


def gradients_from(gp, outs, device) -> list:
    """Each requested input's gradient from the backward program's outputs ``outs``: summed over the lead dims
    the input is broadcast along (torch ``sum``: a reduction launch), slices' parts concatenated with zeros
    between (``torch.cat``: a copy), zeros where the program computes none, and None (as autograd gives) where
    no differentiable path joins the input to an output given a gradient."""
    res = []
    for go in gp.grads:
        def summed(g, go=go):      # an input broadcast along lead dims: the sum of every row's contribution
            return g.sum(go.sum_dims, keepdim=True) if go.sum_dims else g
        if go.parts:
            pieces, col = [], 0
            for j, start, stop in go.parts:
                g = summed(outs[j])
                if start > col:
                    pieces.append(g.new_zeros(*g.shape[:-1], start - col))
                pieces.append(g)
                col = stop
            width = (tuple(go.shape) or (1,))[-1]
            if width > col:
                pieces.append(pieces[-1].new_zeros(*pieces[-1].shape[:-1], width - col))
            res.append(torch.cat(pieces, -1).reshape(go.shape).to(torch_dtype(go.dtype)))
        elif go.output is None:
            res.append(torch.zeros(go.shape, dtype=torch_dtype(go.dtype), device=device) if go.linked else None)
        else:
            res.append(summed(outs[go.output]).reshape(go.shape).to(torch_dtype(go.dtype)))
    return res


def _vp_backward(ctx, grad_outs):
    ins = ctx.saved_tensors
    need = ctx.needs_input_grad[0]
    wrt = tuple(k for k, t in enumerate(ins) if t.is_floating_point() and need[k])
    # one entry per argument autograd saw (trailing arguments left at their defaults are not among them)
    rest = (None,) * (len(ctx.needs_input_grad) - 1)
    if not wrt:
        return ([None] * len(ins),) + rest
    launch = _grad_launch(ctx.program, wrt, _given(grad_outs), ctx.device)
    if launch is not None:
        got = iter(run_grad_program(*launch, ins, grad_outs, ctx.device))
        return ([next(got) if k in wrt else None for k in range(len(ins))],) + rest
    # no derived backward (see _grad_launch): recompute on the host and differentiate with torch autograd
    # (host work, not a simulated launch)
    with torch.enable_grad():
        leaves = [_leaf(t, k in wrt) for k, t in enumerate(ins)]
        outs = run_program_torch(ctx.program, leaves)
        got = _grads(outs, grad_outs, leaves)
    grads = [next(got) if isinstance(x, torch.Tensor) and x.requires_grad else None for x in leaves]
    return ([None if g is None else g.to(t.dtype) for g, t in zip(grads, ins)],) + rest


_vector_program.register_autograd(_vp_backward, setup_context=_vp_setup)


def vector_program(inputs, program, device="ascend910", tiling=None) -> list[torch.Tensor]:
    """Run a :class:`~cost_model.program.Program` (or its JSON) over ``inputs`` as one fused op."""
    p = program if isinstance(program, str) else as_program(program).to_json()
    return torch.ops.autofuse.vector_program(list(inputs), p, device, json.dumps(tiling) if tiling else "")


# ------------------------------------------------------------------------------------------ matmul_epilogue
@torch.library.custom_op("autofuse::matmul_epilogue", mutates_args=())
def _matmul_epilogue(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], extra: list[torch.Tensor],
                     program: str, trans_b: bool = False, device: str = "ascend910",
                     tiling: str = "") -> list[torch.Tensor]:
    prog, r = _launch_matmul_epilogue(a, b, bias, extra, program, trans_b, device, tiling)
    _record("matmul_epilogue", r.stats)
    return [_to_torch(o, torch_dtype(spec.dtype)) for o, spec in zip(r.outputs, prog.outputs)]


@_matmul_epilogue.register_fake
def _(a, b, bias, extra, program, trans_b=False, device="ascend910", tiling=""):
    return _outputs(as_program(program), a)


def _product(a, b, bias, prog, trans_b):
    """The product ``a @ b`` (+ bias) accumulated in fp32, in the dtype and shape the program declares for it."""
    w = b.transpose(-1, -2) if trans_b else b
    acc = a.float() @ w.float()
    if bias is not None:
        acc = acc + bias.float()
    return acc.reshape(prog.inputs[0].shape).to(torch_dtype(prog.inputs[0].dtype))


def reference_matmul_epilogue(a, b, bias, extra, program, trans_b=False, **_):
    """What the kernel computes, in torch: the product accumulated in fp32 (+ bias), in the dtype the program
    declares for it, then the program."""
    prog = as_program(program)
    return run_program_torch(prog, [_product(a, b, bias, prog, trans_b)] + list(extra))


def product_output(prog) -> Optional[int]:
    """The output of ``prog`` (an epilogue's program) that is its input 0 as declared, the product itself: a
    training-mode plan adds it (:func:`autofuse.fused_vector.with_product`) for the backward to read."""
    return next((j for j, o in enumerate(prog.outputs) if o.value == 0 and o.dtype == prog.inputs[0].dtype), None)


def _me_setup(ctx, inputs, output):
    a, b, bias, extra, program, trans_b = inputs[:6]
    prog = as_program(program)
    j = product_output(prog)
    ctx.save_for_backward(a, b, bias, None if j is None else output[j], *extra)
    ctx.program, ctx.trans_b = program, trans_b
    ctx.device = inputs[6] if len(inputs) > 6 else "ascend910"
    ctx.set_materialize_grads(False)     # the product output the forward graph ignores has no gradient


def _me_backward(ctx, grad_outs):
    """d(product) from the derived backward program (one vector_program launch), then dA = d·Bᵀ, dB = Aᵀ·d and
    dbias = the rows' sum of d as torch ops (matmul and reduction launches); the host recompute when the
    program's backward is no Vector program."""
    a, b, bias, product, *extra = ctx.saved_tensors
    need = ctx.needs_input_grad
    prog = as_program(ctx.program)
    wrt = ((0,) if any(need[:3]) else ()) + tuple(k + 1 for k, t in enumerate(extra)
                                                   if t.is_floating_point() and need[3][k])
    rest = (None,) * (len(need) - 4)
    if not wrt:
        return (None, None, None, [None] * len(extra)) + rest
    launch = _grad_launch(ctx.program, wrt, _given(grad_outs), ctx.device)
    if launch is None:
        return _me_backward_host(ctx, grad_outs, a, b, bias, extra) + rest
    if product is None and launch[0].program is not None and reads_input(launch[0].program, 0):
        # an eval-mode plan differentiated anyway wrote no product: a torch matmul recomputes it (one more
        # matmul launch, the cost the training-mode plan's extra product store saves)
        product = _product(a, b, bias, prog, ctx.trans_b)
    elif product is None:      # the backward does not read the product: any tensor of its shape and dtype
        product = a.new_empty(prog.inputs[0].shape, dtype=torch_dtype(prog.inputs[0].dtype))
    else:      # the stored product has the program's lead dims ([1, 8, 32]); its input 0 may be declared flat ([8, 32])
        product = product.reshape(prog.inputs[0].shape)
    got = dict(zip(wrt, run_grad_program(*launch, [product] + extra, grad_outs, ctx.device)))
    ga = gb = gbias = None
    if got.get(0) is not None:
        w = b.transpose(-1, -2) if ctx.trans_b else b
        d = got[0].reshape(*a.shape[:-1], w.shape[-1]).to(a.dtype)       # as eager's linear backward: in a's dtype
        if need[0]:
            ga = d @ w.transpose(-1, -2).to(a.dtype)
        if need[1] and b.dim() == 2:          # as eager's linear / addmm backward: the rows flattened, one mm
            a2, d2 = a.reshape(-1, a.shape[-1]), d.reshape(-1, d.shape[-1])
            gb = (d2.transpose(0, 1) @ a2 if ctx.trans_b else a2.transpose(0, 1) @ d2).to(b.dtype)
        elif need[1]:
            gw = (a.transpose(-1, -2) @ d).sum_to_size(w.shape)
            gb = (gw.transpose(-1, -2) if ctx.trans_b else gw).to(b.dtype)
        if need[2] and bias is not None:
            gbias = d.sum_to_size(bias.shape).to(bias.dtype)
    return (ga, gb, gbias, [got.get(k + 1) for k in range(len(extra))]) + rest


def _me_backward_host(ctx, grad_outs, a, b, bias, extra) -> tuple:
    """The gradients recomputed on the host in fp32 and differentiated with torch autograd (not simulated)."""
    need = ctx.needs_input_grad
    with torch.enable_grad():
        la, lb = _leaf(a, bool(need[0])), _leaf(b, bool(need[1]))
        lbias = _leaf(bias, bool(need[2])) if bias is not None else None
        lextra = [_leaf(t, t.is_floating_point() and need[3][k]) for k, t in enumerate(extra)]
        outs = reference_matmul_epilogue(la, lb, lbias, lextra, ctx.program, ctx.trans_b)
        leaves = [la, lb, lbias] + lextra
        got = _grads(outs, grad_outs, leaves)
    grads = [next(got) if isinstance(x, torch.Tensor) and x.requires_grad else None for x in leaves]
    orig = [a, b, bias] + extra
    grads = [None if g is None else g.to(t.dtype) for g, t in zip(grads, orig)]
    return grads[0], grads[1], grads[2], grads[3:]


_matmul_epilogue.register_autograd(_me_backward, setup_context=_me_setup)


def matmul_epilogue(a, b, program, extra=(), bias=None, trans_b=False, device="ascend910",
                    tiling=None) -> list[torch.Tensor]:
    """``program(a @ b (+ bias), *extra)`` as one fused op (see the module docstring)."""
    p = program if isinstance(program, str) else as_program(program).to_json()
    return torch.ops.autofuse.matmul_epilogue(a, b, bias, list(extra), p, trans_b, device,
                                              json.dumps(tiling) if tiling else "")


def _timing_vector_program(inputs, program, device="ascend910", tiling="", layouts=""):
    return [("vector_program", _launch_vector_program(inputs, program, device, tiling, timing_only=True)[1].stats)]


def _timing_matmul_epilogue(a, b, bias, extra, program, trans_b=False, device="ascend910", tiling=""):
    _, r = _launch_matmul_epilogue(a, b, bias, extra, program, trans_b, device, tiling, timing_only=True)
    return [("matmul_epilogue", r.stats)]


# the torch twins: a repeated launch in a simulation takes its statistics from the first and its values here;
# a simulation without values times the launches on shapes alone (no input steers these kernels)
REFERENCES.update(vector_program=reference_vector_program, matmul_epilogue=reference_matmul_epilogue)
TIMING.update(vector_program=_timing_vector_program, matmul_epilogue=_timing_matmul_epilogue)

__all__ = ["matmul_epilogue", "reference_matmul_epilogue", "reference_vector_program", "vector_program"]
