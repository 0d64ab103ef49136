"""Autograd-only graph ops: they change how the gradient flows, not a value, and run no kernel on the NPU.

``torch.ops.autofuse_grad.pass_gradient(value, source)`` is ``value`` whose gradient goes to ``source``
unchanged (the two have one shape and dtype). It stands where eager's autograd would not see an update: a
tensor made with a gradient and then updated in place inside the forward's own ``torch.no_grad()`` block
(``h.clamp_(-1, 1)``, ``h[:, :3] = 0``). Eager records no such update, so what reads ``h`` after the block gets
the new values and passes its gradient to ``h``'s history as if nothing had happened; a functional graph holds
the update as new nodes, which :func:`autofuse.capture._detach_grad_free_blocks` reads through this op. It is
free on the simulated NPU (a view, as ``detach``), and canonicalize drops it from a graph that runs without grad.

``torch.ops.autofuse_grad.custom_function(args, sizes, key)`` is a custom ``autograd.Function`` of the user's kept
whole (below): its forward's value, its own backward's gradient. ``torch.ops.autofuse_grad.user_function(args,
key)`` is one kept whole by ``fuse()``'s capture: the Function itself, applied when the graph runs.
"""
from __future__ import annotations

import warnings

import torch
import torch.utils._pytree as pytree

#: ``torch.autograd.Function.apply`` as torch defines it (capture replaces it while it traces)
_APPLY = torch.autograd.function.Function.__dict__["apply"].__func__


@torch.library.custom_op("autofuse_grad::pass_gradient", mutates_args=())
def pass_gradient(value: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    return value.clone()        # a custom op returns no alias of its inputs


@pass_gradient.register_fake
def _(value, source):
    return torch.empty_like(value)


def _backward(ctx, grad):
    return None, grad


pass_gradient.register_autograd(_backward)

PASS_GRADIENT = torch.ops.autofuse_grad.pass_gradient.default


def _fresh(outs, args) -> list:
    """An op returns no alias of its inputs: an output that views an argument's storage (a gradient reversal's
    ``x.view_as(x)``) is copied (with grad, the copy's gradient is the view's)."""
    return [o.clone() if any(_aliases(o, a) for a in args) else o for o in outs]


def _aliases(o, a) -> bool:
    """Whether ``o`` and ``a`` share a storage (fake ones too: a traced training step runs the op on them)."""
    from torch.multiprocessing.reductions import StorageWeakRef
    try:
        return StorageWeakRef(o.untyped_storage()) == StorageWeakRef(a.untyped_storage())
    except (RuntimeError, NotImplementedError):     # a tensor without a storage of its own (a functional one)
        return o is a or o._base is not None and (o._base is a or o._base is a._base)


def no_double_backward(op, what: str, *families: str) -> None:
    """Give ``op``, a fused block's backward op with no derivative of its own, an autograd formula that says so by
    name: a gradient of its gradient (``create_graph=True``, then a gradient penalty) raises this instead of torch's
    "no autograd formula was registered". ``families``: the fusion switches that leave such blocks unfused."""
    switches = ", ".join(f"'{f}': 'off'" for f in families)
    def backward(ctx, *grads):
        raise RuntimeError(f"autofuse: a gradient of the gradient (create_graph=True, then differentiating the result) "
                           f"through {what} is not supported: its backward ({op._name}) has no derivative. hint: "
                           f"fuse with fusion_switches={{{switches}}} for that, or run the model eagerly")

    op.register_autograd(backward, setup_context=lambda ctx, inputs, output: None)


# ---------------------------------------------------------------------------------------------------------------
# A custom autograd.Function kept whole: its forward and backward as the graphs Dynamo traced them.
#
# ``torch.ops.autofuse_grad.custom_function(args, sizes, key)`` runs the forward graph registered under ``key`` on
# ``args`` and ``sizes`` and returns its outputs, then the values its backward reads that are not among ``args``; its
# gradient is the backward graph's, given those values. It stands where a Dynamo graph applies a Function whose
# backward is not its forward's derivative (a gradient reversal, a straight-through estimator, PhiMoE's
# sparsemixer): a capture of the graph would keep the forward's ops and differentiate them, so the Function stays one
# op of the user's, as opaque to the planner as any op it has no kernel for, and everything around it fuses.
# ---------------------------------------------------------------------------------------------------------------

def is_grad_mode_call(n: torch.fx.Node) -> bool:
    """Whether ``n`` is a ``torch._C._set_grad_enabled`` call of a Dynamo graph (a Function's bodies open and close
    with one: a Function's forward and backward run without grad)."""
    return n.op == "call_function" and n.target is torch._C._set_grad_enabled


def without_grad_mode_calls(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a Function's body graph without its grad-mode calls (:func:`is_grad_mode_call`): its ops run in
    whatever mode the caller runs them (autograd through them, or below autograd in an op)."""
    import copy
    gm = copy.deepcopy(gm)
    for n in list(gm.graph.nodes):
        if is_grad_mode_call(n):
            gm.graph.erase_node(n)
    gm.recompile()
    return gm


class _Body:
    """A Function's two graphs (grad-mode calls left out: the op runs below autograd); ``places``, per argument of
    its forward, ``("t", j)`` for the op's tensor ``args[j]`` or ``("s", j)`` for its size ``sizes[j]`` (a graph
    Dynamo made dynamic passes the Function its symbolic sizes); and how its backward's arguments are found:
    ``saved``, per value the forward saves, ``("arg", i)`` for the forward's argument ``i`` or ``("out", j)`` for the
    op's extra output ``j``."""

    def __init__(self, fwd, bwd, places, n_outs, saved, non_differentiable, where):
        self.fwd, self.bwd, self.places, self.n_outs, self.saved = fwd, bwd, tuple(places), n_outs, saved
        self.non_differentiable, self.where = tuple(non_differentiable), where

    def arguments(self, args, sizes) -> list:
        return [args[j] if kind == "t" else sizes[j] for kind, j in self.places]

    def same(self, other) -> bool:
        """Whether ``other`` computes what this body does, the same way: the same code for both graphs (and no
        attribute they read: those are the graphs' own values), the same arguments, saved values and line."""
        return (not any(n.op == "get_attr" for g in (self.fwd, self.bwd, other.fwd, other.bwd) for n in g.graph.nodes)
                and (self.fwd.code, self.bwd.code, self.places, self.n_outs, self.saved, self.non_differentiable,
                     self.where) == (other.fwd.code, other.bwd.code, other.places, other.n_outs, other.saved,
                                     other.non_differentiable, other.where))


#: the registered Functions, by key: a process's graphs hold the key (an int, which a graph can carry)
CUSTOM_FUNCTIONS: dict[int, _Body] = {}


def register_custom_function(fwd: torch.fx.GraphModule, bwd: torch.fx.GraphModule, is_size, non_differentiable=(),
                             where: str = "") -> int:
    """Register a Function's forward and backward graphs (as ``autograd_function_apply`` holds them: the forward
    returns ``(outputs, saved)``, the backward takes ``(*output_gradients, *saved)`` and returns one gradient per
    forward argument); ``is_size``, per forward argument, whether it is a size (else a tensor); and ``where`` the
    user's code applies it (for the report). Its key for :func:`custom_function`."""
    fwd, bwd = without_grad_mode_calls(fwd), without_grad_mode_calls(bwd)
    places, counts = [], {"t": 0, "s": 0}
    for size in is_size:
        kind = "s" if size else "t"
        places.append((kind, counts[kind]))
        counts[kind] += 1
    placeholders = [n for n in fwd.graph.nodes if n.op == "placeholder"]
    outs, saved = fwd.graph.output_node().args[0]
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    saved_at, extra = [], 0
    for s in saved:
        if s in placeholders:
            saved_at.append(("arg", placeholders.index(s)))
        else:
            saved_at.append(("out", extra))
            extra += 1
    # Dynamo compiling the same Function again (a new size, a reset) finds its entry
    return _register(CUSTOM_FUNCTIONS, _Body(fwd, bwd, places, len(outs), saved_at, non_differentiable, where))


def _register(registry: dict, entry) -> int:
    """The key of ``entry`` in ``registry`` (keys 0, 1, ...): an earlier entry that is the ``same``, or a new one."""
    for key, other in registry.items():
        if other.same(entry):
            return key
    registry[len(registry)] = entry
    return len(registry) - 1


def _run_forward(args, sizes, key) -> list:
    body = CUSTOM_FUNCTIONS[key]
    with torch.no_grad():
        outs, saved = body.fwd(*body.arguments(args, sizes))
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    return outs + [s for s, (kind, _) in zip(saved, body.saved) if kind == "out"]


@torch.library.custom_op("autofuse_grad::custom_function", mutates_args=())
def custom_function(args: list[torch.Tensor], sizes: list[int], key: int) -> list[torch.Tensor]:
    return _fresh(_run_forward(args, sizes, key), args)


@custom_function.register_fake
def _(args, sizes, key):
    return [o.clone() for o in _run_forward(args, sizes, key)]


def _custom_setup(ctx, inputs, output):
    args, sizes, key = inputs
    body = CUSTOM_FUNCTIONS[key]
    forward_args = body.arguments(args, sizes)
    ctx.key, ctx.n_sizes = key, len(sizes)
    # what the backward reads, in its order: tensors saved (the op's arguments or extra outputs), sizes kept as ints
    saved = [forward_args[i] if kind == "arg" else output[body.n_outs + i] for kind, i in body.saved]
    ctx.save_for_backward(*[v for v in saved if isinstance(v, torch.Tensor)])
    ctx.saved_sizes = [None if isinstance(v, torch.Tensor) else v for v in saved]
    ctx.shapes = [(o.shape, o.dtype) for o in output[:body.n_outs]]
    if body.non_differentiable:
        ctx.mark_non_differentiable(*[output[i] for i in body.non_differentiable])


def _custom_backward(ctx, grads):
    body = CUSTOM_FUNCTIONS[ctx.key]
    # as eager's Function.backward gets them: a zero gradient for an output nothing differentiated
    gouts = [g if g is not None else torch.zeros(s, dtype=d) for g, (s, d) in zip(grads[:body.n_outs], ctx.shapes)]
    tensors = iter(ctx.saved_tensors)
    saved = [next(tensors) if v is None else v for v in ctx.saved_sizes]
    given = body.bwd(*gouts, *saved)
    given = list(given) if isinstance(given, (tuple, list)) else [given]
    given += [None] * (len(body.places) - len(given))
    # one gradient per tensor argument of the op (in its order), none for the sizes and the key (torch.library
    # takes a list of ints as one leaf, and an empty list as a list)
    return [g for g, (kind, _) in zip(given, body.places) if kind == "t"], None if ctx.n_sizes else [], None


custom_function.register_autograd(_custom_backward, setup_context=_custom_setup)

CUSTOM_FUNCTION = torch.ops.autofuse_grad.custom_function.default


# ---------------------------------------------------------------------------------------------------------------
# A custom autograd.Function kept whole by fuse()'s capture: the Function itself, applied when the graph runs.
#
# ``torch.ops.autofuse_grad.user_function(args, key)`` applies the Function registered under ``key`` (its class and
# its call's arguments, the tensors taken out: the op's ``args`` go back in their places) and returns its outputs.
# With grad (a tensor argument that requires it), its autograd kernel applies the Function as eager does, so autograd
# records the Function's own node: its ctx, its saved values, its backward. Otherwise, and while a capture traces it
# (which runs without grad), the op runs below autograd: the Function's forward under no_grad, or its fake run. It
# stands where a forward captured with grad applies a Function whose backward is not its forward's derivative (a
# straight-through estimator, a gradient reversal, PhiMoE's sparsemixer), as ``custom_function`` stands in a
# Dynamo graph: the planner has no kernel for it and fuses around it.
# ---------------------------------------------------------------------------------------------------------------

class _Applied:
    """One kept application: the Function ``cls``, the pytree ``spec`` of its ``(args, kwargs)``, its ``leaves``
    (None where a tensor goes), the user's line ``where``, and ``out_spec``, its outputs' structure (from its first
    run, the capture's fake run)."""

    def __init__(self, cls, spec, leaves, where):
        self.cls, self.spec, self.leaves, self.where = cls, spec, leaves, where
        self.out_spec = None

    def __call__(self, tensors) -> list:
        """Apply the Function to ``tensors`` in their places; its outputs, flat. A non-tensor output (a constant
        the graph cannot carry) or an argument returned as it is (an in-place forward, ``mark_dirty``) raises."""
        it = iter(tensors)
        args, kwargs = pytree.tree_unflatten([next(it) if x is None else x for x in self.leaves], self.spec)
        out = _APPLY(self.cls, *args, **kwargs)
        flat, spec = pytree.tree_flatten(out)
        if not all(isinstance(o, torch.Tensor) for o in flat):
            raise TypeError(f"{self.cls.__qualname__} returns a value that is not a tensor")
        if any(o is t for o in flat for t in tensors):
            raise TypeError(f"{self.cls.__qualname__} returns its argument (an in-place forward)")
        self.out_spec = spec if self.out_spec is None else self.out_spec
        return flat

    def same(self, other) -> bool:
        """Whether ``other`` applies the same Function to arguments of the same structure and values."""
        if other.cls is not self.cls or other.spec != self.spec or len(other.leaves) != len(self.leaves):
            return False
        try:
            return all(type(a) is type(b) and (a is b or bool(a == b)) for a, b in zip(other.leaves, self.leaves))
        except Exception:  # noqa: BLE001 - values that do not compare are not the same call
            return False


#: the kept applications, by key (an int a graph carries)
USER_FUNCTIONS: dict[int, _Applied] = {}


def register_user_function(cls, spec, leaves, where: str) -> int:
    """The key of the application of ``cls`` to ``(args, kwargs)`` (its pytree ``spec`` and ``leaves``, None for
    each tensor), made at ``where``: an earlier one with the same class, structure and values, or a new one."""
    return _register(USER_FUNCTIONS, _Applied(cls, spec, leaves, where))


@torch.library.custom_op("autofuse_grad::user_function", mutates_args=())
def user_function(args: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    with torch.no_grad():
        return _fresh(USER_FUNCTIONS[key](args), args)


@user_function.register_fake
def _(args, key):
    with torch.no_grad():
        return [o.clone() for o in USER_FUNCTIONS[key](args)]


def _user_function_autograd(keyset, args, key):
    """The op's autograd kernel: with grad, the Function applied as eager applies it (autograd records its own
    node); otherwise below autograd, as a custom op's generated kernel does."""
    if torch.is_grad_enabled() and any(a.requires_grad for a in args):
        return _fresh(USER_FUNCTIONS[key](args), args)
    return USER_FUNCTION_OP.redispatch(keyset & torch._C._after_autograd_keyset, args, key)


USER_FUNCTION_OP = torch.ops.autofuse_grad.user_function.default
_LIB = torch.library.Library("autofuse_grad", "FRAGMENT")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")         # torch warns that this replaces the custom op's generated kernel
    _LIB.impl("user_function", _user_function_autograd, "Autograd", with_keyset=True)
