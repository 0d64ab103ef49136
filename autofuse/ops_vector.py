"""Generated Vector kernels as fused torch ops: ``torch.ops.autofuse.vector_program`` and ``matmul_epilogue``.

    outs = torch.ops.autofuse.vector_program(inputs, program_json, "ascend910", "", "", saved_json)
    outs = torch.ops.autofuse.matmul_epilogue(a, b, bias, extra, program_json, False, "ascend910", "", saved_json)
    outs = autofuse.ops_vector.vector_program(inputs, program)          # Program or JSON; tiling as a dict

``program`` is a :class:`cost_model.program.Program` as JSON (``Program.to_json()``); ``tiling`` a JSON object
(``""`` = the kernel's default); ``saved`` a JSON list of output numbers (``""``: none) whose values the backward
reads in place of recomputing them (each stored in its value's own dtype: a training plan's choice, see
:func:`autofuse.fused_vector.kept_values`). Autograd keeps, of the inputs and those outputs, only what the derived
backward reads (a residual add keeps nothing). Each op's CPU implementation runs its simulator kernel and records the
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
from cost_model.program_grad import NotDifferentiable, backward_program, pruned
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
    orders = json.loads(layouts)          # outputs past them (values kept for the backward) are row-major
    return [in_order(t, order) for t, order in zip(outs, orders)] + list(outs[len(orders):])


@torch.library.custom_op("autofuse::vector_program", mutates_args=())
def _vector_program(inputs: list[torch.Tensor], program: str, device: str = "ascend910",
                    tiling: str = "", layouts: str = "", saved: str = "") -> list[torch.Tensor]:
    prog, r = _launch_vector_program(inputs, program, device, tiling)
    _record("vector_program", r.stats)
    return _laid_out([_to_torch(o, torch_dtype(spec.dtype)) for o, spec in zip(r.outputs, prog.outputs)], layouts)


@_vector_program.register_fake
def _(inputs, program, device="ascend910", tiling="", layouts="", saved=""):
    return _laid_out(_outputs(as_program(program), inputs[0]), layouts)


def reference_vector_program(inputs, program, layouts="", **_):
    """What the kernel computes, in torch (the program's numerics: fp32 steps, rounding at casts and outputs)."""
    return _laid_out(run_program_torch(program, inputs), layouts)


def _vp_setup(ctx, inputs, output):
    ins, program = inputs[0], inputs[1]
    ctx.program = program
    ctx.device = inputs[2] if len(inputs) > 2 else "ascend910"
    ctx.saved = tuple(json.loads(inputs[5])) if len(inputs) > 5 and inputs[5] else ()
    ctx.set_materialize_grads(False)     # an output nobody reads has no gradient: the backward loads none
    wrt = tuple(k for k, t in enumerate(ins) if t.is_floating_point() and t.requires_grad)
    ctx.wrt = wrt
    values = [output[j] for j in ctx.saved]
    ctx.save_for_backward(*_keep(ctx, list(ins), values, wrt, len(as_program(program).outputs)))


def _reads(gp, nin: int) -> tuple:
    """``(inputs, values)`` a backward launch reads of the forward: the numbers of its inputs (of ``nin``) and of
    its saved outputs' values (positions in ``gp.saved``)."""
    if gp.program is None:
        return frozenset(), frozenset()
    past = nin + len(gp.grad_of)
    return frozenset(i for i in gp.takes if i < nin), frozenset(i - past for i in gp.takes if i >= past)


def _keep(ctx, ins: list, values: list, wrt: tuple, n_outputs: int) -> list:
    """What to save for the backward: what its launch for ``wrt`` reads (from every output's gradient) of the
    forward's inputs ``ins`` and saved values ``values``, every input where it is recomputed on the host (no
    derived Vector backward); ``ctx.kept``: ``(inputs, values)`` numbers kept, None for all. A tensor the backward
    does not read is not kept for it: autograd frees it when nothing else holds it."""
    launch = _grad_launch(ctx.program, wrt, tuple(range(n_outputs)), ctx.device, ctx.saved) if wrt else None
    ctx.kept = None if wrt and launch is None else _reads(launch[0], len(ins)) if wrt else \
        (frozenset(), frozenset())
    if ctx.kept is None:
        return list(ins) + list(values)
    return [t for k, t in enumerate(ins) if k in ctx.kept[0]] + [t for k, t in enumerate(values) if k in ctx.kept[1]]


def _unkept(ctx, saved: tuple, nin: int) -> tuple:
    """``(inputs, values)`` as setup saved them (``saved``: what it saved past its own first tensors; read
    ``ctx.saved_tensors`` once: under a checkpoint each read recomputes), None where not kept."""
    got = iter(saved)
    kin, kval = ctx.kept if ctx.kept is not None else (range(nin), range(len(ctx.saved)))
    ins = [next(got) if k in kin else None for k in range(nin)]
    return ins, [next(got) if k in kval else None for k in range(len(ctx.saved))]


def _backward_launch(ctx, wrt, grad_outs, nin: int, n_outputs: int):
    """The backward launch for the gradients given, or where it reads what setup did not keep, the one setup kept
    for (its inputs, every output's gradient: missing ones are zeros); None: recompute on the host (setup kept
    every input)."""
    launch = _grad_launch(ctx.program, wrt, _given(grad_outs), ctx.device, ctx.saved)
    if ctx.kept is None or launch is not None and all(r <= k for r, k in zip(_reads(launch[0], nin), ctx.kept)):
        return launch
    return _grad_launch(ctx.program, ctx.wrt, tuple(range(n_outputs)), ctx.device, ctx.saved)


@functools.lru_cache(maxsize=256)
def _grad_launch(program: str, wrt: tuple, outputs: tuple, device: str, saved: tuple = ()):
    """``(GradProgram, tiling JSON)`` of the backward of ``program`` for inputs ``wrt`` from the gradients of
    ``outputs`` (reading the values of outputs ``saved``), its program taking only the inputs it reads
    (:func:`~cost_model.program_grad.pruned`), the tiling the cost model's search picks for it on ``device``; None
    when the backward is no Vector program that fits (an instruction without a derivable gradient, or shuffles in
    rows too wide for UB)."""
    for split in (False, True):      # slice gradients as separate outputs when their cat needs too wide rows
        try:
            gp = pruned(backward_program(program, wrt, outputs, split=split, saved=saved))
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


def run_grad_program(gp, tiling, ins, grad_outs, device, values=()) -> list:
    """The gradients of the inputs ``gp.grads`` names, from one ``vector_program`` launch of ``gp.program`` over
    the forward's inputs ``ins``, its outputs' gradients ``grad_outs`` (None: zero) and the values of its outputs
    ``gp.saved`` (``values``), those the program takes (an input it does not read may be None), assembled by
    :func:`gradients_from`."""
    outs = []
    on = next((t.device for t in (*ins, *grad_outs, *values) if isinstance(t, torch.Tensor)), torch.device("cpu"))
    if gp.program is not None:
        nin, ngrad = len(ins), len(gp.grad_of)
        takes = range(len(gp.program.inputs)) if gp.takes is None else gp.takes
        args = []
        for pos, i in enumerate(takes):
            if i < nin:
                args.append(ins[i])
            elif i < nin + ngrad:
                spec = gp.program.inputs[pos]
                g = grad_outs[gp.grad_of[i - nin]]
                args.append(torch.zeros(spec.shape, dtype=torch_dtype(spec.dtype), device=on) if g is None else
                            g.to(torch_dtype(spec.dtype)).reshape(spec.shape).contiguous())
            else:
                args.append(values[i - nin - ngrad])
        outs = torch.ops.autofuse.vector_program(args, gp.program.to_json(), device, tiling)
    return gradients_from(gp, outs, on)


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
    need = ctx.needs_input_grad[0]
    ins, values = _unkept(ctx, ctx.saved_tensors, len(need))
    wrt = tuple(k for k in range(len(ins)) if need[k])
    # one entry per argument autograd saw (trailing arguments left at their defaults are not among them)
    rest = (None,) * (len(ctx.needs_input_grad) - 1)
    if not wrt:
        return ([None] * len(ins),) + rest
    launch = _backward_launch(ctx, wrt, grad_outs, len(ins), len(grad_outs))
    if launch is not None:
        got = dict(zip((go.input for go in launch[0].grads), run_grad_program(*launch, ins, grad_outs, ctx.device,
                                                                               values)))
        return ([got.get(k) if k in wrt else None for k in range(len(ins))],) + rest
    # no derived backward (see _grad_launch): recompute on the host and differentiate with torch autograd
    # (host work, not a simulated launch; setup kept every input for it)
    with torch.enable_grad():
        leaves = [_leaf(t, k in wrt) for k, t in enumerate(ins)]
        outs = run_program_torch(ctx.program, leaves)
        got = _grads(outs, grad_outs, leaves)
    grads = [next(got) if isinstance(x, torch.Tensor) and x.requires_grad else None for x in leaves]
    return ([None if g is None else g.to(t.dtype) for g, t in zip(grads, ins)],) + rest


_vector_program.register_autograd(_vp_backward, setup_context=_vp_setup)


def vector_program(inputs, program, device="ascend910", tiling=None, saved=()) -> list[torch.Tensor]:
    """Run a :class:`~cost_model.program.Program` (or its JSON) over ``inputs`` as one fused op; its backward reads
    the values of outputs ``saved`` (each stored in its value's own dtype) in place of recomputing them."""
    p = program if isinstance(program, str) else as_program(program).to_json()
    return torch.ops.autofuse.vector_program(list(inputs), p, device, json.dumps(tiling) if tiling else "", "",
                                             json.dumps(list(saved)) if saved else "")


# ------------------------------------------------------------------------------------------ matmul_epilogue
@torch.library.custom_op("autofuse::matmul_epilogue", mutates_args=())
def _matmul_epilogue(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], extra: list[torch.Tensor],
                     program: str, trans_b: bool = False, device: str = "ascend910",
                     tiling: str = "", saved: str = "") -> list[torch.Tensor]:
    prog, r = _launch_matmul_epilogue(a, b, bias, extra, program, trans_b, device, tiling)
    _record("matmul_epilogue", r.stats)
    return [_to_torch(o, torch_dtype(spec.dtype)) for o, spec in zip(r.outputs, prog.outputs)]


@_matmul_epilogue.register_fake
def _(a, b, bias, extra, program, trans_b=False, device="ascend910", tiling="", saved=""):
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
    training-mode plan adds it (:func:`autofuse.fused_vector.with_saved`) for the backward to read."""
    return next((j for j, o in enumerate(prog.outputs) if o.value == 0 and o.dtype == prog.inputs[0].dtype), None)


def _me_setup(ctx, inputs, output):
    a, b, bias, extra, program, trans_b = inputs[:6]
    prog = as_program(program)
    ctx.program, ctx.trans_b, ctx.n_extra = program, trans_b, len(extra)
    ctx.device = inputs[6] if len(inputs) > 6 else "ascend910"
    ctx.saved = tuple(json.loads(inputs[8])) if len(inputs) > 8 and inputs[8] else ()
    ctx.set_materialize_grads(False)     # outputs the forward graph ignores (what is kept) have no gradient
    # the program's inputs: the product (of a, b and bias: kept for dA and dB, as eager's linear keeps them), then
    # the extra ones; the product the kernel stored is kept where the backward reads it
    ctx.wrt = ((0,) if any(t is not None and t.requires_grad for t in (a, b, bias)) else ()) + \
        tuple(k + 1 for k, t in enumerate(extra) if t.is_floating_point() and t.requires_grad)
    j = product_output(prog)
    ins = [None if j is None else output[j]] + list(extra)
    ctx.save_for_backward(a, b, bias, *_keep(ctx, ins, [output[k] for k in ctx.saved], ctx.wrt, len(prog.outputs)))


def _me_backward(ctx, grad_outs):
    """d(product) from the derived backward program (one vector_program launch), then dA = d·Bᵀ, dB = Aᵀ·d and
    dbias = the rows' sum of d as torch ops (matmul and reduction launches); the host recompute when the
    program's backward is no Vector program."""
    a, b, bias, *kept = ctx.saved_tensors
    (product, *extra), values = _unkept(ctx, kept, 1 + ctx.n_extra)
    need = ctx.needs_input_grad
    prog = as_program(ctx.program)
    wrt = ((0,) if any(need[:3]) else ()) + tuple(k + 1 for k, t in enumerate(need[3]) if t)
    rest = (None,) * (len(need) - 4)
    if not wrt:
        return (None, None, None, [None] * len(extra)) + rest
    launch = _backward_launch(ctx, wrt, grad_outs, 1 + len(extra), len(grad_outs))
    if launch is None:
        return _me_backward_host(ctx, grad_outs, a, b, bias, extra) + rest
    if product is None and launch[0].program is not None and 0 in launch[0].takes:
        # an eval-mode plan differentiated anyway wrote no product: a torch matmul recomputes it (one more
        # matmul launch, the cost the training-mode plan's extra product store saves)
        product = _product(a, b, bias, prog, ctx.trans_b)
    elif product is not None:      # stored with the program's lead dims ([1, 8, 32]); input 0 may be flat ([8, 32])
        product = product.reshape(prog.inputs[0].shape)
    got = dict(zip((go.input for go in launch[0].grads), run_grad_program(*launch, [product] + extra, grad_outs,
                                                                          ctx.device, values)))
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
    return (ga, gb, gbias, [got.get(k + 1) if need[3][k] else None for k in range(len(extra))]) + rest


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
                    tiling=None, saved=()) -> list[torch.Tensor]:
    """``program(a @ b (+ bias), *extra)`` as one fused op (see the module docstring); its backward reads the
    values of outputs ``saved`` (each stored in its value's own dtype) in place of recomputing them."""
    p = program if isinstance(program, str) else as_program(program).to_json()
    return torch.ops.autofuse.matmul_epilogue(a, b, bias, list(extra), p, trans_b, device,
                                              json.dumps(tiling) if tiling else "",
                                              json.dumps(list(saved)) if saved else "")


def _timing_vector_program(inputs, program, device="ascend910", tiling="", layouts="", saved=""):
    return [("vector_program", _launch_vector_program(inputs, program, device, tiling, timing_only=True)[1].stats)]


def _timing_matmul_epilogue(a, b, bias, extra, program, trans_b=False, device="ascend910", tiling="", saved=""):
    _, r = _launch_matmul_epilogue(a, b, bias, extra, program, trans_b, device, tiling, timing_only=True)
    return [("matmul_epilogue", r.stats)]


# the torch twins: a repeated launch in a simulation takes its statistics from the first and its values here;
# a simulation without values times the launches on shapes alone (no input steers these kernels)
REFERENCES.update(vector_program=reference_vector_program, matmul_epilogue=reference_matmul_epilogue)
TIMING.update(vector_program=_timing_vector_program, matmul_epilogue=_timing_matmul_epilogue)

__all__ = ["matmul_epilogue", "reference_matmul_epilogue", "reference_vector_program", "vector_program"]
