"""Lowering: which simulator kernels execute one aten node.

The simulator (``autofuse.simulate``) runs these kernels and the planner (``autofuse.plan``) prices them
with the cost model, so both read one table and can never disagree about what an op costs to launch.

``lower(node)`` returns a :class:`Program`: a short list of :class:`Step` s, each a kernel call whose
inputs are the node's tensor arguments (``Arg(i)``) or earlier steps' outputs (``Out(j)``). The node's
value is the last step's first output. Views (reshape of a contiguous tensor, transpose, expand, slicing,
``getitem``...) lower to no step: they only re-describe memory. An op with no dedicated kernel lowers to
``generic``: one Vector pass that reads its inputs from GM and writes its outputs back.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autofuse import graph
from autofuse.grad_ops import PASS_GRADIENT
from autofuse.vector_program import (_ACTIVATION_ATEN, _COMBINE_ATEN, _FORMULA_ATEN, _NORM_ATEN, _PRELU_ATEN,
                                     _VAR_ATEN, rms_norm_args)
from cost_model.devices import ITEMSIZE

aten = torch.ops.aten


@dataclass(frozen=True)
class Arg:
    """The ``i``-th tensor input of the node (in :func:`tensor_inputs` order)."""
    i: int


@dataclass(frozen=True)
class Out:
    """The first output of step ``j``."""
    j: int


@dataclass(frozen=True)
class Const:
    """A constant tensor the lowering needs: ``"tril"``, a bool lower-triangular mask of ``shape``;
    ``"keep_bits"``, a dropout keep-mask's bytes (uint8, one bit per element: its values never matter,
    the kernel reading it is priced by its bytes); ``"saved"``, an intermediate of ``dtype`` that eager's
    forward wrote to GM and autograd keeps for the backward but the graph does not hold (the attention
    probabilities an SDPA backward reads): zeros here, the kernel reading it is priced by its bytes."""
    kind: str
    shape: tuple
    dtype: str = ""

    def spec(self):
        return tuple(self.shape), (self.dtype or ("uint8" if self.kind == "keep_bits" else "bool"))

    def make(self):
        if self.kind == "keep_bits":
            return torch.zeros(self.shape, dtype=torch.uint8)
        if self.kind == "saved":       # one zero, broadcast: a [B, H, S, S] stand-in allocates nothing
            return torch.zeros((), dtype=getattr(torch, self.dtype)).expand(self.shape)
        return torch.ones(self.shape, dtype=torch.bool).tril()


@dataclass(frozen=True)
class View:
    """Step input ``ref`` (an :class:`Arg` or :class:`Const`) broadcast to ``expand`` (when given), then reshaped
    to ``shape``: an operand a kernel reads in another layout, such as a grouped-query attention's q heads
    stacked along the rows of the key/value head they share."""
    ref: object
    shape: tuple
    expand: tuple | None = None

    def of(self, t):
        return (t.expand(self.expand) if self.expand else t).reshape(self.shape)


@dataclass
class Step:
    kernel: str
    inputs: tuple
    params: dict = field(default_factory=dict)


@dataclass
class Program:
    steps: list
    inputs: list          # the fx nodes feeding Arg(i)

    @property
    def free(self) -> bool:
        return not self.steps


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's tensor-valued fx inputs, in argument order, without repeats."""
    seen = []
    for a in node.all_input_nodes:
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor) and a not in seen:
            seen.append(a)
    return seen


def _meta(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _dt(n) -> str:
    return str(_meta(n).dtype).replace("torch.", "")


def _scalar(x):
    return isinstance(x, (int, float, bool)) and not isinstance(x, torch.Tensor)


_VIEW_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default, aten.t.default,
    aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims,
    aten.slice.Tensor, aten.select.int, aten.alias.default, aten.detach.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.unbind.int, aten.as_strided.default, aten.lift_fresh_copy.default,
    aten.unflatten.int, aten.flatten.using_ints, aten.narrow.default, aten.chunk.default, operator.getitem,
    aten.sym_size.int, aten.view_as_complex.default, aten.view_as_real.default,   # complex <-> float pairs: views
    PASS_GRADIENT,                    # a gradient's route only (autofuse.grad_ops): no values move
}
# Ops that make small constant tensors (iota, fills): a launch that writes its output once.
_FACTORY_OPS = {aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default,
                aten.zeros.default, aten.ones.default, aten.new_ones.default, aten.new_zeros.default,
                aten.new_full.default, aten.empty.memory_format, aten.scalar_tensor.default, aten.zeros_like.default,
                aten.ones_like.default, aten.full_like.default}

_UNARY = {
    aten.neg.default: "neg", aten.abs.default: "abs", aten.exp.default: "exp", aten.log.default: "log",
    aten.sqrt.default: "sqrt", aten.rsqrt.default: "rsqrt", aten.reciprocal.default: "reciprocal",
    aten.relu.default: "relu", aten.sigmoid.default: "sigmoid", aten.tanh.default: "tanh",
    aten.silu.default: "silu", aten.sin.default: "sin", aten.cos.default: "cos", aten.erf.default: "erf",
    aten.log1p.default: "log1p", aten.expm1.default: "expm1", aten.floor.default: "floor", aten.ceil.default: "ceil",
    aten.trunc.default: "trunc", aten.round.default: "round", aten.sign.default: "sign",
}
_BINARY = {
    aten.add.Tensor: "add", aten.sub.Tensor: "sub", aten.mul.Tensor: "mul", aten.div.Tensor: "div",
    aten.maximum.default: "maximum", aten.minimum.default: "minimum", aten.pow.Tensor_Tensor: "pow",
    aten.add.Scalar: "add", aten.sub.Scalar: "sub", aten.mul.Scalar: "mul", aten.div.Scalar: "div",
    aten.pow.Tensor_Scalar: "pow", aten.rsub.Scalar: "rsub",
}
_COMPARE = {aten.eq.Tensor: "eq", aten.ne.Tensor: "ne", aten.lt.Tensor: "lt", aten.le.Tensor: "le",
            aten.gt.Tensor: "gt", aten.ge.Tensor: "ge", aten.eq.Scalar: "eq", aten.ne.Scalar: "ne",
            aten.lt.Scalar: "lt", aten.le.Scalar: "le", aten.gt.Scalar: "gt", aten.ge.Scalar: "ge"}
_LOGIC = {aten.logical_and.default: "logical_and", aten.logical_or.default: "logical_or",
          aten.__and__.Tensor: "logical_and", aten.__or__.Tensor: "logical_or", aten.bitwise_and.Tensor: "logical_and",
          aten.bitwise_or.Tensor: "logical_or", aten.logical_not.default: "logical_not",
          aten.bitwise_not.default: "logical_not"}
_REDUCE = {aten.sum.dim_IntList: "sum", aten.mean.dim: "mean", aten.amax.default: "max",
           aten.amin.default: "min", aten.sum.default: "sum", aten.mean.default: "mean"}


def _is_view_reshape(node) -> bool:
    src = _meta(node.args[0])
    return src is not None and src.is_contiguous()


def _matmul_operand(n: fx.Node):
    """(source node, transposed?) — a transpose of the last two dims of a contiguous tensor is free."""
    if (n.op == "call_function" and n.target in (aten.transpose.int, aten.t.default)
            and _meta(n.args[0]) is not None and _meta(n.args[0]).is_contiguous()):
        r = _meta(n).dim()
        dims = [0, 1] if n.target == aten.t.default else [d % r for d in n.args[1:3]]
        if sorted(dims) == [r - 2, r - 1]:
            return n.args[0], True
    return n, False


def _dma_loadable(m) -> bool:
    """Whether the Cube kernel can load each matrix of ``m`` straight from its layout: one of the last two dims
    is unit-stride, so every tile is a 2-D strided block of contiguous rows (or columns, loaded transposed).
    Batch dims may have any strides (each batch matrix is its own region). Otherwise a copy lays it out."""
    if m.is_contiguous():
        return True
    return m.stride(-1) == 1 or m.stride(-2) == 1 or m.shape[-1] == 1 or m.shape[-2] == 1


def _clone_is_free(node: fx.Node) -> bool:
    """Whether eager makes no copy for this ``clone``.

    In a captured graph, ``torch.export`` writes an inactive dropout (eval mode: eager returns its input) as a
    ``clone`` of a contiguous tensor without a memory format, exactly as it writes an explicit ``x.clone()``;
    the recorded source line tells them apart (``.clone(`` there: the user's copy, priced). A ``clone`` with
    ``memory_format`` (``.contiguous()`` of a strided tensor, ``reshape`` that cannot view) is a copy in eager
    too. In a training step's graph (:mod:`autofuse.training`) a clone traced from a captured clone is priced
    as that one; a clone autograd's decompositions add (``matmul`` into ``bmm`` on copied operands, and the
    copies its derivative makes) is free when it only lays out a batched GEMM operand
    (:func:`_lays_out_batched_operand`): the same price as the captured ``matmul``."""
    src = node.meta.get("autofuse_source")
    if src is not None and src.target == aten.clone.default:
        return _clone_is_free(src)
    if "autofuse_phase" in node.meta:
        return _lays_out_batched_operand(node)
    x = _meta(node.args[0]) if node.args else None
    if x is None or node.kwargs.get("memory_format") not in (None, torch.preserve_format) or not x.is_contiguous():
        return False
    return ".clone(" not in (node.meta.get("stack_trace") or "")


_BATCH_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default}
_BATCHED_GEMMS = {aten.bmm.default, aten.matmul.default, aten.baddbmm.default}


def _lays_out_batched_operand(node: fx.Node) -> bool:
    """Whether ``clone(x)`` only lays out a batched GEMM's operand that the Cube could load from ``x`` as it
    is: ``aten.matmul`` on 3-D and 4-D operands decomposes (under autograd, or in a traced training step) into
    ``expand`` → ``clone`` → ``_unsafe_view`` → ``bmm``, copying a transposed or head-split operand to merge
    its batch dims. The GEMM kernel reads each batch matrix as its own strided region
    (:func:`_dma_loadable`), so the copy is free when every use reaches a batched GEMM through views that
    keep the last two dims (or swap them: a transpose the GEMM folds), and ``x`` is loadable: the same price
    as the undecomposed ``matmul``."""
    src = node.args[0] if node.args else None
    m = _meta(node)
    if not isinstance(src, fx.Node) or m is None or m.dim() < 3 or not _dma_loadable(_meta(src)):
        return False
    todo, seen_gemm = list(node.users), False
    while todo:
        u = todo.pop()
        um = _meta(u)
        if u.target in _BATCHED_GEMMS and um is not None:
            seen_gemm = True
            continue
        swap = u.target in (aten.transpose.int, aten.t.default) and um is not None and \
            sorted(d % um.dim() for d in (u.args[1:3] if u.target == aten.transpose.int else (0, 1))) == \
            [um.dim() - 2, um.dim() - 1]       # a transpose the GEMM folds (a saved operand, in a backward)
        if not (u.target in _BATCH_VIEWS or swap) or um is None or \
                sorted(um.shape[-2:]) != sorted(m.shape[-2:]):
            return False
        todo += list(u.users)
    return seen_gemm


def _lower_matmul(node, a, b, bias=None, trans_b=False):
    (sa, ta), (sb, tb) = _matmul_operand(a), _matmul_operand(b)
    tb = tb != trans_b
    inputs, steps, refs = [], [], []
    for src in (sa, sb):
        m = _meta(src)
        if m.dim() >= 2 and not _dma_loadable(m):
            inputs.append(src)
            steps.append(Step("copy", (Arg(len(inputs) - 1),)))
            refs.append(Out(len(steps) - 1))
        else:
            inputs.append(src)
            refs.append(Arg(len(inputs) - 1))
    params = {"trans_a": ta, "trans_b": tb}
    args = [refs[0], refs[1]]
    if bias is not None:
        inputs.append(bias)
        params["bias"] = Arg(len(inputs) - 1)
    if _meta(sa).dim() == 1 or _meta(sb).dim() == 1:
        return Program([Step("generic", tuple(Arg(i) for i in range(len(inputs))))], inputs)
    steps.append(Step("matmul", tuple(args), params))
    return Program(steps, inputs)


_CONVS = {aten.conv1d.default: 1, aten.conv2d.default: 2, aten.conv1d.padding: 1, aten.conv2d.padding: 2,
          aten.convolution.default: None}
_CUBE = ("float16", "bfloat16", "float32")


def _same_padding(w, dilation, nd):
    """``padding="same"`` as one pad per side, or None where torch pads one side more (an even extent)."""
    ks = tuple(w.shape[2:])
    dil = tuple(dilation) if isinstance(dilation, (list, tuple)) else (dilation,) * nd
    totals = [d * (k - 1) for d, k in zip(dil, ks)]
    return None if any(t % 2 for t in totals) else tuple(t // 2 for t in totals)


def _lower_conv(node, t, ins):
    """``aten.conv1d`` / ``conv2d`` / ``convolution`` (what ``nn.Conv1d``/``nn.Conv2d`` capture as: groups and depthwise,
    stride, padding, dilation, bias) -> the Cube's implicit GEMM (``conv``), after a copy of an input the kernel
    cannot read as NCHW. None, so that the node is priced as a generic pass: a transposed convolution, a 3-D one,
    ``padding="same"`` that pads one side more than the other, another dtype than the Cube's, or sizes the capture
    left symbolic."""
    x, w = graph.arg(node, 0, "input"), graph.arg(node, 1, "weight")
    bias = graph.arg(node, 2, "bias")
    stride, padding, dilation = (graph.arg(node, i, n, 1 if n != "padding" else 0)
                                 for i, n in ((3, "stride"), (4, "padding"), (5, "dilation")))
    if t == aten.convolution.default:
        if graph.arg(node, 6, "transposed", False):
            return None
        groups = graph.arg(node, 8, "groups", 1)
    else:
        groups = graph.arg(node, 6, "groups", 1)
    xm, wm, om = _meta(x), _meta(w), _meta(node)
    nd = _CONVS[t] or wm.dim() - 2
    if nd not in (1, 2) or wm.dim() != nd + 2 or not isinstance(om, torch.Tensor) or \
            {_dt(x), _dt(w)} - set(_CUBE) or _dt(x) != _dt(w) or \
            not all(isinstance(d, int) for d in (*xm.shape, *wm.shape)):
        return None
    if isinstance(padding, str):
        padding = 0 if padding == "valid" else _same_padding(wm, dilation, nd)
        if padding is None:
            return None
    def as_list(v):         # one value per spatial dim: torch repeats a single one (padding=(1,) of a conv2d)
        v = tuple(int(e) for e in v) if isinstance(v, (list, tuple)) else (int(v),)
        return v * nd if len(v) == 1 else v
    params = {"stride": as_list(stride), "padding": as_list(padding), "dilation": as_list(dilation),
              "groups": int(groups)}
    inputs, steps = [x, w], []
    ref = Arg(0)
    if xm.dim() == nd + 1:                 # an unbatched input: one image
        ref = View(Arg(0), (1, *xm.shape))
    elif not xm.is_contiguous():           # a transposed sequence (a Conv1d over a projection's [B, L, C] output)
        steps.append(Step("copy", (Arg(0),)))
        ref = Out(0)
    if isinstance(bias, fx.Node):
        inputs.append(bias)
        params["bias"] = Arg(2)
    steps.append(Step("conv", (ref, Arg(1)), params))
    return Program(steps, inputs)


def _dropout_steps(shape, p: float, src) -> list:
    """Eager dropout on the NPU (torch_npu's ``native_dropout``): DropOutGenMask writes the keep bits, then
    DropOutDoMask reads the input and the bits and writes the output (a generic pass over both)."""
    bits = (*shape[:-1], -(-shape[-1] // 8))
    return [Step("dropout_gen_mask", (), {"shape": list(shape), "keep_prob": 1.0 - p}),
            Step("generic", (src, Const("keep_bits", bits)))]


def _lower_dropout(node, t, ins):
    """Training-mode dropout (``native_dropout``, which draws even at p = 0; ``dropout`` for 0 < p < 1); an
    eval-mode one, or ``dropout`` outside 0 < p < 1 (eager draws nothing), lowers to no launch."""
    p, train = float(node.args[1]) if len(node.args) > 1 else 0.5, node.args[2] if len(node.args) > 2 else True
    if t == aten.dropout.default and (not train or not 0.0 < p < 1.0):
        return Program([], ins)
    if t == aten.native_dropout.default and train is False:
        return Program([], ins)
    return Program(_dropout_steps(tuple(_meta(node.args[0]).shape), p, Arg(0)), ins[:1])


def _lower_sdpa(node):
    """Unfused SDPA (``scaled_dot_product_attention`` and the variants its dispatch calls) = what eager runs op
    by op (:func:`_sdpa_program`); None for a variant given its own dropout mask (not one of these ops)."""
    a = _sdpa_arguments(node)
    return None if a is None else _sdpa_program(**a)


def _sdpa_arguments(node) -> dict | None:
    """The attention's arguments, by name, from any of SDPA's call forms:
    ``scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale)``,
    ``_scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, dropout_mask, *, scale)``, and
    ``_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask, scale)`` (and its
    ``_backward``, whose arguments follow ``grad_out`` and the saved ``out`` and ``logsumexp``)."""
    t, args, kw = node.target, list(node.args), node.kwargs

    def get(i, name, default=None):
        return kw.get(name, args[i] if i < len(args) else default)
    if t == aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        args = args[1:4] + args[6:]
    if t in (aten._scaled_dot_product_flash_attention_for_cpu.default,
             aten._scaled_dot_product_flash_attention_for_cpu_backward.default):
        mask, p, causal = kw.get("attn_mask"), get(3, "dropout_p", 0.0), get(4, "is_causal", False)
    else:
        if get(6, "dropout_mask") is not None:
            return None
        mask, p, causal = get(3, "attn_mask"), get(4, "dropout_p", 0.0), get(5, "is_causal", False)
    scale = kw.get("scale", args[6] if t == aten.scaled_dot_product_attention.default and len(args) > 6 else None)
    return dict(q=args[0], k=args[1], v=args[2], mask=_bool_mask_of(mask), causal=bool(causal), scale=scale,
                dropout_p=float(p or 0.0))


def _bool_mask_of(mask):
    """The bool mask an additive one was made from, when ``mask`` is SDPA's conversion of it for the CPU flash
    kernel (``where(m, 0, -inf)``, which the training step's trace records before the kernel): eager applies
    the bool mask itself (a ``where``, as :func:`_sdpa_program` prices it), so the conversion is no launch
    (:func:`_is_sdpa_mask_conversion`). Any other mask as it is."""
    return mask.args[0] if isinstance(mask, fx.Node) and _is_sdpa_mask_conversion(mask) else mask


def _scalar_tensor_value(n):
    if isinstance(n, fx.Node) and n.target == aten.scalar_tensor.default and _scalar(n.args[0]):
        return float(n.args[0])
    return None


_CPU_FLASH = (aten._scaled_dot_product_flash_attention_for_cpu.default,
              aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


def _is_sdpa_mask_conversion(node) -> bool:
    """``where(m, 0, -inf)`` of a bool ``m`` read only as the CPU flash kernels' ``attn_mask``."""
    if node.op != "call_function" or node.target != aten.where.self or _meta(node.args[0]) is None \
            or _meta(node.args[0]).dtype != torch.bool:
        return False
    if (_scalar_tensor_value(node.args[1]), _scalar_tensor_value(node.args[2])) != (0.0, float("-inf")):
        return False
    return bool(node.users) and all(u.target in _CPU_FLASH and u.kwargs.get("attn_mask") is node
                                    and node not in u.args for u in node.users)


def _sdpa_scale(q, scale) -> float:
    return float(scale) if scale is not None else _meta(q).shape[-1] ** -0.5


def _sdpa_program(q, k, v, mask, causal, scale, dropout_p) -> Program:
    """Eager SDPA op by op: S = Q·Kᵀ, S·scale, the mask (bool: ``where(m, S, -inf)``; additive: ``S + m``), the
    causal ``where`` (a lower-triangular constant), P = softmax(S), dropout on P, P·V. P is written to GM.
    Grouped-query heads (``enable_gqa``) in the grouped layout (:func:`_gqa_layout`)."""
    inputs = [q, k, v]
    g = _gqa_layout(q, k)
    steps = [Step("matmul", (g(Arg(0), _meta(q).shape), Arg(1)), {"trans_b": True}),
             Step("elementwise", (Out(0),), {"op": "mul", "scalar": _sdpa_scale(q, scale)})]
    if mask is not None:
        inputs.append(mask)
        m = g(Arg(3), _meta(mask).shape)
        if _meta(mask).dtype == torch.bool:
            steps.append(Step("elementwise", (m, Out(1)), {"op": "where", "scalar": float("-inf")}))
        else:
            steps.append(Step("elementwise", (Out(1), m), {"op": "add"}))
    if causal:
        sq, skv = _meta(q).shape[-2], _meta(k).shape[-2]
        steps.append(Step("elementwise", (g(Const("tril", (sq, skv)), (sq, skv)), Out(len(steps) - 1)),
                          {"op": "where", "scalar": float("-inf")}))
    steps.append(Step("softmax", (Out(len(steps) - 1),), {"dim": -1}))
    if 0.0 < dropout_p < 1.0:           # dropout on the weights [..., Sq, Skv]
        steps += _dropout_steps(_sdpa_probs_shape(q, k), dropout_p, Out(len(steps) - 1))
    steps.append(Step("matmul", (Out(len(steps) - 1), Arg(2))))
    return Program(steps, inputs)


def _gqa_layout(q, k):
    """``layout(ref, shape)`` for attention of ``q [..., N, Sq, D]`` over ``k [..., Nkv, Skv, D]``: an operand of the
    q-head layout ``[..., N or 1, Sq, W]`` (q, a mask, the causal constant, an output gradient) as eager's GEMMs
    read it. With grouped-query heads (N = rep·Nkv; q head h reads k/v head h // rep, as SDPA's ``enable_gqa``
    and ``repeat_interleave`` pair them) that is ``[..., Nkv, rep·Sq, W]``: each k/v head's queries stacked
    along the rows, so Q·Kᵀ gives the scores ``[..., Nkv, rep·Sq, Skv]``, the [N, Sq, Skv] scores in that order
    (a view of heads-major q). This prices eager without the copies of k and v its math path makes per q head:
    a competent eager reads each k/v head in place. Without grouping, the operand as it is."""
    heads = _gqa_heads(q, k)
    if heads is None:
        return lambda ref, shape: ref
    lead, N, nkv = heads
    sq = _meta(q).shape[-2]
    return lambda ref, shape: View(ref, (*lead, nkv, N // nkv * sq, shape[-1]), (*lead, N, sq, shape[-1]))


def _gqa_heads(q, k):
    """``(lead dims, N, Nkv)`` when ``q`` has more heads than ``k`` (grouped-query attention), else None."""
    qm, km = _meta(q), _meta(k)
    if qm.dim() < 3 or km.dim() < 3 or qm.shape[-3] == km.shape[-3]:
        return None
    return tuple(_broadcast(qm.shape[:-3], km.shape[:-3])), qm.shape[-3], km.shape[-3]


def _sdpa_probs_shape(q, k) -> tuple:
    """The attention weights' shape ``[..., N, Sq, Skv]`` (q's heads)."""
    qm, km = _meta(q), _meta(k)
    heads = _gqa_heads(q, k)
    lead = (*heads[0], heads[1]) if heads else _broadcast(qm.shape[:-2], km.shape[:-2])
    return (*lead, qm.shape[-2], km.shape[-2])


def lower(node: fx.Node) -> Program:
    """The kernels that execute ``node`` (see the module docstring)."""
    t = node.target
    if node.op != "call_function":
        return Program([], [])
    ins = tensor_inputs(node)
    if t in _VIEW_OPS:
        return Program([], ins)
    m = node.meta.get("val")
    if isinstance(m, torch.Tensor) and m.numel() == 0:
        return Program([], ins)             # an empty result (Phi-3's pass-through part at full rotary): no work
    if t in (aten.native_dropout.default, aten.dropout.default):
        return _lower_dropout(node, t, ins)
    if t in (aten.reshape.default,):
        return Program([] if _is_view_reshape(node) else [Step("copy", (Arg(0),))], ins[:1])
    if t in (aten.clone.default, aten.contiguous.default, aten.copy.default):
        if t == aten.clone.default and _clone_is_free(node):
            return Program([], ins[:1])
        return Program([Step("copy", (Arg(0),))], ins[:1])
    if t in (aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout):
        return Program([Step("elementwise", (Arg(0),), {"op": "cast", "out_dtype": _dt(node)})], ins[:1])
    if t in (aten.matmul.default, aten.mm.default, aten.bmm.default):
        return _lower_matmul(node, node.args[0], node.args[1])
    if t == aten.linear.default:
        return _lower_matmul(node, node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else None,
                             trans_b=True)
    if t == aten.addmm.default and len(node.args) == 3 and not node.kwargs:
        return _lower_matmul(node, node.args[1], node.args[2], node.args[0])
    if t in _CONVS:
        conv = _lower_conv(node, t, ins)
        if conv is not None:
            return conv
    if t in (aten.softmax.int, aten._softmax.default, aten._safe_softmax.default):
        return Program([Step("softmax", (Arg(0),), {"dim": node.args[1]})], ins[:1])
    if t in (aten.scaled_dot_product_attention.default, aten._scaled_dot_product_attention_math.default,
             aten._scaled_dot_product_flash_attention_for_cpu.default):
        sdpa = _lower_sdpa(node)
        if sdpa is not None:
            return sdpa
    if t == aten.where.self and _is_sdpa_mask_conversion(node):
        return Program([], ins)
    if t in _UNARY:
        return Program([Step("elementwise", (Arg(0),), {"op": _UNARY[t]})], ins[:1])
    if t == aten.gelu.default:
        approx = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return Program([Step("elementwise", (Arg(0),), {"op": "gelu_tanh" if approx == "tanh" else "gelu"})], ins)
    if t in _ACTIVATIONS:
        act = _lower_activation(node, ins)
        if act is not None:
            return act
    if t in _BINARY:
        a, b = node.args[0], node.args[1] if len(node.args) > 1 else None
        op = _BINARY[t]
        if isinstance(a, fx.Node) and isinstance(b, fx.Node) and isinstance(_meta(b), torch.Tensor) and \
                _meta(b).dim() > 0:
            return Program([Step("elementwise", (Arg(0), Arg(1 if b is not a else 0)), {"op": op})], ins)
        scalar = b if not isinstance(b, fx.Node) else None
        if scalar is not None and _scalar(scalar):
            return Program([Step("elementwise", (Arg(0),), {"op": op, "scalar": float(scalar)})], ins[:1])
    if t in _COMPARE:
        b = node.args[1]
        if isinstance(b, fx.Node):
            return Program([Step("elementwise", (Arg(0), Arg(ins.index(b))), {"op": _COMPARE[t]})], ins)
        if _scalar(b):
            return Program([Step("elementwise", (Arg(0),), {"op": _COMPARE[t], "scalar": float(b)})], ins[:1])
    if t in _LOGIC and all(isinstance(a, fx.Node) for a in node.args):
        return Program([Step("elementwise", tuple(Arg(ins.index(a)) for a in node.args), {"op": _LOGIC[t]})], ins)
    if t == aten.where.ScalarOther and _scalar(node.args[2]):
        return Program([Step("elementwise", (Arg(0), Arg(ins.index(node.args[1]))),
                             {"op": "where", "scalar": float(node.args[2])})], ins)
    if t == aten.where.self and len(ins) == 3:
        return Program([Step("elementwise", (Arg(0), Arg(1), Arg(2)), {"op": "where"})], ins)
    if t == aten.masked_fill.Scalar and _scalar(node.args[2]):
        return Program([Step("elementwise", (Arg(0), Arg(ins.index(node.args[1]))),
                             {"op": "masked_fill", "scalar": float(node.args[2])})], ins)
    if t in (aten.layer_norm.default, aten.native_layer_norm.default):
        # native_layer_norm (what layer_norm dispatches to under autograd) also returns the rows' mean and
        # rstd for its backward: fp32 per row, 8 bytes a row next to the row's 2·D or 4·D, not counted
        x, _, w, b = (list(node.args) + [None] * 4)[:4]
        eps = node.args[4] if len(node.args) > 4 else node.kwargs.get("eps", 1e-5)
        params = {"eps": float(eps)}
        for key, ref in (("weight", w), ("bias", b)):
            if isinstance(ref, fx.Node):
                params[key] = Arg(ins.index(ref))
        return Program([Step("layer_norm", (Arg(0),), params)], ins)
    if t == aten.rms_norm.default:
        # torch's own RMSNorm over the last dim: CANN's RmsNorm (which takes a weight; without one, a generic pass)
        _, shape, w, eps = rms_norm_args(node)
        if len(shape) == 1 and isinstance(w, fx.Node):
            return Program([Step("rms_norm", (Arg(0), Arg(ins.index(w))), {"eps": eps})], ins)
    if t in _REDUCE:
        dims = node.args[1] if len(node.args) > 1 else None
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        return Program([Step("reduce", (Arg(0),), {"op": _REDUCE[t], "dim": tuple(dims) if dims else None,
                                                    "keepdim": bool(keep)})], ins[:1])
    if t == aten.embedding.default:
        return Program([Step("gather", (Arg(0), Arg(1)))], ins)
    if t == aten.cat.default:
        dim = node.args[1] if len(node.args) > 1 else 0
        return Program([Step("cat", tuple(Arg(ins.index(a)) for a in node.args[0]), {"dim": dim})], ins)
    bwd = _lower_backward(node, t, ins)
    if bwd is not None:
        return bwd
    moe = _lower_moe(node, t, ins)
    if moe is not None:
        return moe
    coll = _lower_collective(node, t, ins)
    if coll is not None:
        return coll
    if t == aten.scalar_tensor.default:
        # a 0-d constant (``where(c, x, 0.0)`` as autograd dispatches it): the op reading it takes an immediate
        return Program([], ins)
    if t in _FACTORY_OPS and not ins:
        return Program([Step("generic", ())], [])
    return Program([Step("generic", tuple(Arg(i) for i in range(len(ins))))], ins)


def _grouped_mm_fallback(name="grouped_mm_fallback"):
    """``torch.ops.transformers.<name>`` (``grouped_mm_fallback`` or its ``_backward``) when transformers has
    registered it, else None."""
    ns = getattr(torch.ops, "transformers", None)
    try:
        return getattr(ns, name).default if ns is not None else None
    except AttributeError:
        return None


def _stored_weight(w):
    """(the weight as stored, transposed?): a ``transpose`` of a contiguous ``[E, N, K]`` weight's last two dims
    is read as it is stored (the GEMM kernels load it transposed)."""
    if (w.op == "call_function" and w.target == aten.transpose.int and _meta(w.args[0]).is_contiguous()
            and sorted(d % 3 for d in w.args[1:3]) == [1, 2]):
        return w.args[0], True
    return w, False


def _lower_moe(node, t, ins):
    """Ops of eager MoE blocks that have kernels of their own: topk (last dim), row gathers (index_select /
    index on dim 0), row scatter-adds (index_add on dim 0), transformers' grouped_mm_fallback and its
    backward (one matmul launch per expert, as they run without a grouped GEMM; the backward's two per
    expert) and torch's ``_grouped_mm`` in its forward form (one grouped launch). None: not one of them."""
    a = node.args
    if t == aten.topk.default:
        x = _meta(a[0])
        dim = a[2] if len(a) > 2 else node.kwargs.get("dim", -1)
        largest = a[3] if len(a) > 3 else node.kwargs.get("largest", True)
        if x is not None and x.dim() >= 1 and dim % x.dim() == x.dim() - 1:
            return Program([Step("topk", (Arg(0),), {"k": int(a[1]), "largest": bool(largest)})], ins[:1])
    if t == aten.index_select.default and a[1] % max(_meta(a[0]).dim(), 1) == 0 and _meta(a[0]).dim() >= 2:
        return Program([Step("gather", (Arg(0), Arg(1)))], [a[0], a[2]])
    if t == aten.index.Tensor and len(a[1]) == 1 and isinstance(a[1][0], fx.Node) and _meta(a[0]).dim() >= 2 \
            and _meta(a[1][0]).dtype in (torch.int64, torch.int32):
        return Program([Step("gather", (Arg(0), Arg(1)))], [a[0], a[1][0]])
    if t == aten.index_add.default and a[1] % max(_meta(a[0]).dim(), 1) == 0:
        alpha = node.kwargs.get("alpha", a[4] if len(a) > 4 else 1)
        return Program([Step("index_add", (Arg(0), Arg(1), Arg(2)), {"alpha": float(alpha)})], [a[0], a[2], a[3]])
    if t is not None and t == _grouped_mm_fallback():
        w, trans = _stored_weight(a[1])
        return Program([Step("matmul_per_group", (Arg(0), Arg(1), Arg(2)),
                             {"trans_w": trans, "group_list_type": "cumsum"})], [a[0], w, a[2]])
    if t == aten._grouped_mm.default and len(a) == 3 and not any(v is not None for v in node.kwargs.values()) \
            and _meta(a[0]).dim() == 2 and _meta(a[1]).dim() == 3:
        # torch's grouped GEMM (transformers' bf16 experts): one grouped launch, as CANN's GroupedMatmul
        w, trans = _stored_weight(a[1])
        return Program([Step("grouped_matmul", (Arg(0), Arg(1), Arg(2)),
                             {"trans_w": trans, "group_list_type": "cumsum"})], [a[0], w, a[2]])
    if t is not None and t == _grouped_mm_fallback("grouped_mm_fallback_backward"):
        # its loop: per expert, dx_g = dy_g · w_gᵀ and dw_g = x_gᵀ · dy_g, two matmul launches each
        w, trans = _stored_weight(a[1])
        return Program([Step("matmul_per_group", (Arg(3), Arg(1), Arg(2)),
                             {"trans_w": not trans, "group_list_type": "cumsum"}),
                        Step("matmul_per_group_weight_grad", (Arg(0), Arg(3), Arg(2)), {"group_list_type": "cumsum"})],
                       [a[0], w, a[2], a[3]])
    return None


def _lower_collective(node, t, ins):
    """``_c10d_functional`` collectives: the collective kernel over the group's ranks (``world``; ``comm``, the
    group's name, lets a simulation exchange with the real ranks); ``wait_tensor`` is free. None: not one, or
    its group cannot be resolved in this process (then it is priced as generic)."""
    c10d = getattr(torch.ops, "_c10d_functional", None)
    if c10d is None or not isinstance(t, torch._ops.OpOverload) or t.namespace != "_c10d_functional":
        return None
    if t == c10d.wait_tensor.default:
        return Program([], ins[:1])
    kinds = {c10d.all_reduce.default: "all_reduce", c10d.all_gather_into_tensor.default: "all_gather",
             c10d.reduce_scatter_tensor.default: "reduce_scatter", c10d.all_to_all_single.default: "all_to_all"}
    if t not in kinds:
        return None
    from autofuse.groups import group_size
    name = node.args[-1]
    world = group_size(name)
    if world is None:
        return None
    params = {"world": world, "comm": name}
    if t == c10d.all_to_all_single.default:
        params.update(output_split_sizes=node.args[1], input_split_sizes=node.args[2])
    return Program([Step(kinds[t], (Arg(0),), params)], ins[:1])


def _broadcast(*shapes):
    return tuple(torch.broadcast_shapes(*[torch.Size(s) for s in shapes]))


PAIRS = {"complex32": "float16", "complex64": "float32", "complex128": "float64"}
_SAME_SIZE = {1: "uint8", 2: "float16", 4: "float32", 8: "float64"}


def known_specs(x, seen: set):
    """Specs in ``x`` with dtypes the cost model prices: a complex tensor as the float pairs it is stored as
    (Llama 4's rotary embedding multiplies complex64 values), another unknown dtype (float8) as a dtype of its
    item size; ``seen`` collects the dtypes replaced."""
    if isinstance(x, dict):
        return {k: known_specs(v, seen) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        if len(x) == 2 and isinstance(x[1], str) and isinstance(x[0], (list, tuple)):
            shape, dtype = x
            if dtype in ITEMSIZE:
                return x
            seen.add(dtype)
            if dtype in PAIRS:
                return tuple(shape) + (2,), PAIRS[dtype]
            return tuple(shape), _SAME_SIZE[getattr(torch, dtype).itemsize]
        return type(x)(known_specs(v, seen) for v in x)
    return x


def known_tensor(t):
    """``t`` as :func:`known_specs` prices it: a complex tensor as its float pairs, float8 as bytes."""
    if not isinstance(t, torch.Tensor) or str(t.dtype).replace("torch.", "") in ITEMSIZE:
        return t
    if t.is_complex():
        return torch.view_as_real(t)
    return t.view(getattr(torch, _SAME_SIZE[t.itemsize]))


def step_specs(program: Program, node: fx.Node) -> list[tuple[list, tuple]]:
    """Per step: its input specs ``[(shape, dtype), ...]`` and its output spec, from the nodes' metadata."""
    out = []
    spec_of = {}

    def spec(ref):
        if isinstance(ref, View):
            return tuple(ref.shape), spec(ref.ref)[1]
        if isinstance(ref, Const):
            return ref.spec()
        if isinstance(ref, Arg):
            m = _meta(program.inputs[ref.i])
            return tuple(m.shape), str(m.dtype).replace("torch.", "")
        return spec_of[ref.j]

    node_meta = _meta(node)
    for j, st in enumerate(program.steps):
        ins = [spec(r) for r in st.inputs]
        if j == len(program.steps) - 1 and isinstance(node_meta, torch.Tensor):
            o = (tuple(node_meta.shape), str(node_meta.dtype).replace("torch.", ""))
        elif isinstance(node_meta, (tuple, list)) and j == len(program.steps) - 1 and \
                any(isinstance(m, torch.Tensor) for m in node_meta):
            first = next(m for m in node_meta if isinstance(m, torch.Tensor))     # outputs not asked for: None
            o = (tuple(first.shape), str(first.dtype).replace("torch.", ""))
        elif st.kernel == "matmul":
            (sa, da), (sb, _) = ins[0], ins[1]
            ta, tb = st.params.get("trans_a"), st.params.get("trans_b")
            m_ = sa[-1] if ta else sa[-2]
            n_ = sb[-2] if tb else sb[-1]
            o = (_broadcast(sa[:-2], sb[:-2]) + (m_, n_), da)
        elif st.kernel == "dropout_gen_mask":
            sh = st.params["shape"]
            o = ((*sh[:-1], -(-sh[-1] // 8)), "uint8")
        elif st.kernel == "elementwise":
            shapes = [s for s, _ in ins]
            o = (_broadcast(*shapes), st.params.get("out_dtype") or ins[-1][1])
        else:
            o = ins[0] if ins else ((), "float32")
        spec_of[j] = o
        out.append((ins, o))
    return out


# ------------------------------------------------------------------------------ backward ops (training steps)
# Autograd's derivative ops, as a training step's backward dispatches them (autofuse.training). Eager on an
# NPU runs each as one dedicated kernel (CANN's GeluGrad, SoftmaxGrad, LayerNormGrad, ...): a row-wise chain
# of Vector work over its inputs, which is what a generated Vector kernel (``vector_program``) runs. Each is
# written here as its formula in torch ops, traced on meta tensors into a Vector program; the node's value
# still comes from torch (the simulator prices the launch).

def _gelu_grad(g, x, approximate="none"):
    if approximate == "tanh":
        k = 0.7978845608028654
        inner = k * (x + 0.044715 * x * x * x)
        t = torch.tanh(inner)
        return g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x))
    # erf is not a Vector op; the Vector unit's gelu gives Phi(x) = gelu(x) / x (0.5 at 0)
    phi = torch.where(x == 0, 0.5, torch.nn.functional.gelu(x) / x)
    return g * (phi + x * torch.exp(-0.5 * x * x) * 0.3989422804014327)


def _softmax_grad(g, y, dim, input_dtype):
    return (y * (g - (g * y).sum(-1, keepdim=True))).to(input_dtype)


def _log_softmax_grad(g, y, dim, input_dtype):
    return (g - torch.exp(y) * g.sum(-1, keepdim=True)).to(input_dtype)


def _layer_norm_dx(g, x, mean, rstd, w=None):
    xhat = (x - mean) * rstd
    gw = g * w if w is not None else g
    return rstd * (gw - gw.mean(-1, keepdim=True) - xhat * (gw * xhat).mean(-1, keepdim=True))


_ROW_GRADS = {
    aten.threshold_backward.default: lambda g, y, threshold: g.masked_fill(y <= threshold, 0.0),
    aten.gelu_backward.default: _gelu_grad,
    aten.silu_backward.default: lambda g, x: g * torch.sigmoid(x) * (1 + x * (1 - torch.sigmoid(x))),
    aten.sigmoid_backward.default: lambda g, y: g * y * (1 - y),
    aten.tanh_backward.default: lambda g, y: g * (1 - y * y),
    aten._softmax_backward_data.default: _softmax_grad,
    aten._log_softmax_backward_data.default: _log_softmax_grad,
}


def _row_grad_program(fn, metas, consts):
    """The Vector program of ``fn(*tensors, *consts)`` traced on meta tensors shaped as ``metas``, and the
    tensors' positions it reads, in its input order; None when a Vector program cannot express it."""
    return _row_grad_cached(fn, tuple((tuple(m.shape), m.dtype) for m in metas), tuple(consts))


@functools.lru_cache(maxsize=512)
def _row_grad_cached(fn, specs, consts):
    from torch.fx.experimental.proxy_tensor import make_fx
    from autofuse.vector_program import NotExpressible, ProgramError, program_from_nodes
    fakes = [torch.empty(shape, dtype=dt, device="meta") for shape, dt in specs]
    try:
        gm = make_fx(lambda *ts: fn(*ts, *consts), tracing_mode="fake")(*fakes)
        out = gm.graph.output_node().args[0]
        built = program_from_nodes([n for n in gm.graph.nodes if n.op == "call_function"],
                                   [out[0] if isinstance(out, (tuple, list)) else out])
    except (NotExpressible, ProgramError, RuntimeError, TypeError):
        return None
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if any(i not in phs for i in built.inputs):
        return None
    return built.program, [phs.index(i) for i in built.inputs]


#: the ops a generated kernel writes with its own instructions (log_sigmoid_forward's pair of outputs is no one
#: program's value)
_ACTIVATIONS = (_ACTIVATION_ATEN - {aten.log_sigmoid_forward.default}) | _VAR_ATEN | _COMBINE_ATEN | _FORMULA_ATEN | \
    _NORM_ATEN | _PRELU_ATEN | {aten.pow.Scalar}


def _lower_activation(node, ins):
    """An activation or a row's variance eager runs as one kernel of its own (CANN's Softplus, Mish, LeakyRelu, Elu,
    HardSwish, ReduceStdV2, ...): one Vector launch of the instructions a generated kernel runs for it, the program
    of the node alone (None when that is no program: a variance over another dim than the last)."""
    from autofuse.vector_program import NotExpressible, ProgramError, program_from_nodes
    try:
        built = program_from_nodes([node], [node])
    except (NotExpressible, ProgramError):
        return None
    return Program([Step("vector_program", tuple(Arg(ins.index(i)) for i in built.inputs),
                         {"program": built.program})], ins)


def _lower_backward(node, t, ins):
    """A derivative op as one generated Vector kernel (with column reductions for a norm's weight and bias
    gradients); None when ``node`` is not one or its shapes are not a row-wise chain."""
    a = list(node.args)
    tensors = [x for x in a if isinstance(x, fx.Node)]
    if t in _ROW_GRADS:
        if t in (aten._softmax_backward_data.default, aten._log_softmax_backward_data.default):
            y = _meta(a[1])
            if y is None or a[2] % y.dim() != y.dim() - 1:
                return None                       # a softmax over another dim: not row-wise
        metas = [_meta(x) for x in tensors]
        consts = [x for x in a[len(tensors):]]
        if any(isinstance(x, fx.Node) for x in consts) or any(m is None for m in metas):
            return None
        if t == aten.gelu_backward.default:
            consts = [node.kwargs.get("approximate", a[2] if len(a) > 2 else "none")]
        built = _row_grad_program(_ROW_GRADS[t], metas, consts)
        if built is None:
            return None
        prog, order = built
        return Program([Step("vector_program", tuple(Arg(ins.index(tensors[i])) for i in order),
                             {"program": prog})], ins)
    if t == aten.native_layer_norm_backward.default:
        g, x, shape, mean, rstd, w, b, mask = (a + [None] * 8)[:8]
        if len(shape) != 1:
            return None
        parts = [g, x, mean, rstd] + ([w] if isinstance(w, fx.Node) else [])
        built = _row_grad_program(_layer_norm_dx, [_meta(p) for p in parts], [])
        if built is None:
            return None
        prog, order = built
        mask = list(mask) if mask is not None else [True, True, True]
        # the input's gradient only when autograd asks for it (not for a graph input that needs none)
        steps = [Step("vector_program", tuple(Arg(ins.index(parts[i])) for i in order), {"program": prog})][:mask[0]]
        rows = tuple(range(_meta(g).dim() - 1))
        # the weight's and bias's gradients sum over the rows (g·x̂ and g): a reduction launch each over a
        # [rows, D] tensor in the gradient's dtype (LayerNormGrad accumulates per-core partial sums instead:
        # this is an upper bound by a read of the gradient each)
        for want in mask[1:]:
            if want:
                steps.append(Step("reduce", (Arg(ins.index(g)),), {"op": "sum", "dim": rows, "keepdim": False}))
        return Program(steps, ins)
    if t == aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        return _lower_sdpa_backward(node)
    if t == aten.native_dropout_backward.default:
        # DropOutDoMask on the gradient: the gradient and the keep bits read, the result written
        shape = tuple(_meta(a[0]).shape)
        return Program([Step("generic", (Arg(0), Const("keep_bits", (*shape[:-1], -(-shape[-1] // 8)))))], ins[:1])
    return None


def _lower_sdpa_backward(node):
    """The backward of eager's op-by-op SDPA (:func:`_sdpa_program`) as autograd runs it, for the CPU flash
    kernel's backward in a training step's graph. The forward wrote the probabilities P to GM and autograd
    keeps them (a ``"saved"`` constant: the graph holds the flash kernel's logsumexp instead). Steps, in order:
    dV = Pᵀ·dO; dP = dO·Vᵀ; dS = P·(dP − rowsum(dP·P)) (softmax's backward, the Vector program
    ``_softmax_backward_data`` lowers to); each ``where`` of the forward's mask and causal mask gives
    ``where(m, dS, 0)`` (an additive mask passes the gradient as it is); dS·scale; dK = dSᵀ·Q; dQ = dS·K (last:
    the node's first output). None for a dropout (the CPU flash kernel takes none)."""
    a = _sdpa_arguments(node)
    if a is None or a["dropout_p"] > 0.0:
        return None
    q, k, v, mask = a["q"], a["k"], a["v"], a["mask"]
    g = node.args[0]
    inputs = [g, q, k, v] + ([mask] if mask is not None else [])
    lay = _gqa_layout(q, k)
    shape = _sdpa_probs_shape(q, k)
    probs = lay(Const("saved", shape, str(_meta(q).dtype).replace("torch.", "")), shape)  # as its GEMMs wrote it
    dt = _meta(g).dtype
    built = _row_grad_program(_softmax_grad, [torch.empty(probs.shape, dtype=dt, device="meta")] * 2, [-1, dt])
    if built is None:
        return None
    prog, order = built
    go, qv = lay(Arg(0), _meta(g).shape), lay(Arg(1), _meta(q).shape)
    steps = [Step("matmul", (probs, go), {"trans_a": True}),                       # dV
             Step("matmul", (go, Arg(3)), {"trans_b": True})]                      # dP
    steps.append(Step("vector_program", tuple((Out(1), probs)[i] for i in order), {"program": prog}))
    if a["causal"]:
        sq, skv = _meta(q).shape[-2], _meta(k).shape[-2]
        steps.append(Step("elementwise", (lay(Const("tril", (sq, skv)), (sq, skv)), Out(len(steps) - 1)),
                          {"op": "where", "scalar": 0.0}))
    if mask is not None and _meta(mask).dtype == torch.bool:
        steps.append(Step("elementwise", (lay(Arg(4), _meta(mask).shape), Out(len(steps) - 1)),
                          {"op": "where", "scalar": 0.0}))
    steps.append(Step("elementwise", (Out(len(steps) - 1),), {"op": "mul", "scalar": _sdpa_scale(q, a["scale"])}))
    ds = Out(len(steps) - 1)
    steps += [Step("matmul", (ds, qv), {"trans_a": True}),                          # dK
              Step("matmul", (ds, Arg(2)))]                                         # dQ
    return Program(steps, inputs)
