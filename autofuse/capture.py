"""Capture: an ``nn.Module`` plus example inputs -> one aten-level ``torch.fx.GraphModule``.

Two routes produce the same graph form:

* ``"export"`` (default): the graph of ``torch.export.export(model, args, kwargs, strict=False)``
  followed by ``run_decompositions({})``. This captures current transformers models whole. The empty
  decomposition table keeps composite ops such as ``aten.matmul``, ``aten.linear``, ``aten.softmax`` and
  ``aten.scaled_dot_product_attention`` intact, functionalises the graph and turns eval-mode dropout
  into a ``clone``. That pair traces the model twice (a pre-dispatch trace, then a re-trace of its graph
  to functional aten); :func:`_export_functional` traces it once, straight to functional aten, with the
  composite ops preserved exactly as ``run_decompositions({})`` preserves them (the same context around
  the same tracer). The two give the same graph (code, ``val`` shapes, dtypes and strides, module
  stacks; tests/test_capture.py compares them on many models); a parameter shared under several names
  (tied embeddings) is read, as the re-trace reads it, through its last name. Only the re-trace's
  provenance metadata (``from_node``, ``seq_nr``, ``original_aten``) is absent.
* ``"symbolic_trace"``: ``torch.fx.symbolic_trace`` for plain modules (its leaf-module and
  ``fx.wrap`` rules apply), then lowered to the same functional aten level and FakeTensor meta by the
  same non-strict export tracer (``make_fx(pre_dispatch=True)`` + functionalization). A hand-rolled
  ``make_fx(functionalize(f), pre_dispatch=True)`` drops parameters as constants in torch 2.13, so
  the lowering is shared rather than duplicated.
* ``"auto"``: export, falling back to symbolic_trace; if both fail the error names both.

The shared form (what :class:`Captured` holds):

1. ``graph_module`` has one placeholder per pytree leaf of ``(example_args, example_kwargs)``, in
   ``torch.utils._pytree.tree_leaves`` order (non-tensor leaves such as ``use_cache=False`` included,
   they are simply unused), and returns a flat tuple of output leaves.
2. Parameters and buffers are ``get_attr`` nodes whose targets are the model's own dotted names;
   the attributes are the *same tensor objects* as in the user's model (no copies).
3. Every node except ``output`` carries ``node.meta["val"]``: a FakeTensor (shape, dtype, device)
   or, for non-tensor placeholders, the Python value.

Call it either through ``Captured(*args, **kwargs)`` (flattens inputs with ``in_spec`` and rebuilds
the user's output structure with ``out_spec``) or directly as ``graph_module(*leaves)``.

4. Parameter and buffer ``get_attr`` nodes carry ``node.meta["autofuse_state"]`` (the dotted name in the
   user's model): their values belong to the user, who may change them at any time, so nothing may be
   folded from them (a plan that depends on one keeps a guard). Constants the tracer lifted (tensors
   created inside ``forward``) carry no such mark.

Capture keeps the model's own mode: a model in ``train()`` is captured with its training semantics
(dropout stays, as ``native_dropout``), one in ``eval()`` with eval semantics. ``Captured.training``
records which. The user's model is left as it was.
Example inputs may live on the ``meta`` device (a model built under ``torch.device("meta")``): no
real data is touched, so very large configurations can be analysed.

5. **Data-dependent shapes.** A forward whose sizes come from values (JetMoe's experts split the routed
   tokens by counts read with ``.tolist()``) exports with unbacked symbols in its ``val`` shapes. Such a
   graph is run once on the example inputs and those nodes' ``val`` are replaced by the sizes that run
   produced, so that matching and pricing see plain shapes; every node whose value or input had a
   data-dependent size carries ``node.meta["autofuse_data_dependent"]`` (the nodes that read the sizes from
   data), those whose own sizes do also ``["autofuse_data_sized"]``; the planner fuses no block that reads or gives
   the graph a value of data-dependent size (they run as captured, for whatever sizes later calls bring), and a
   block whose sizes depend on data only inside (a hand-written MoE layer's expert loop) as one call.
   On meta inputs there is nothing to run: capture says so.
6. **Copies into a view** (``x[..., i] = y``, ``copy_``) are functionalized to ``aten.copy``, which autograd cannot
   differentiate; where the result's layout cannot matter they are spelled ``expand`` + ``clone`` (or a cast): the
   same values, trainable.
7. **State the forward updates in place** (BatchNorm's running statistics in training mode, a parameter clamped
   through ``.data``): ``torch.export`` functionalizes each update into a new value of that buffer or parameter.
   Those values are the graph's last outputs, after the user's; ``Captured.state_updates`` names their targets
   and ``Captured.update_state`` copies them into the model's tensors after a call, as eager leaves them. An
   **input tensor** the forward updates in place (a static KV cache's keys and values, written at the new
   positions by ``index_copy_``) is the same: its new value follows, ``Captured.input_updates`` holds its place
   among the flat inputs, and ``update_state`` copies it into the caller's tensor. An update of anything else (an
   attribute that is not a registered buffer) is a capture error, and so are a parameter that requires grad
   updated in training mode (Gemma 3n clamps one through ``.data``) and an input that requires grad updated in
   place: eager's reads after the update carry its gradient, the functional graph's new value does not.
8. **Sizes seen before.** Given a :class:`autofuse.sizes.SizeFamilies` (a fused module keeps one), a call whose
   structure was captured before at other sizes is not exported again: one export with those sizes symbolic is
   specialised to the call's sizes, giving the graph a fresh export gives, up to whole-dim slices (see
   :mod:`autofuse.sizes`).
9. **transformers' float16 overflow clamp** (``if h.dtype == torch.float16 and not torch.isfinite(h).all(): h =
   torch.clamp(h, ...)``, BART and its kin; ``torch.isinf(h).any()`` in LongT5) branches on values, which torch.export
   refuses. Recognised by its source while the forward is traced, it is captured as ``torch.where`` over both
   branches (:func:`_overflow_clamps`): the graph tests at every call and clamps where eager clamps. Every other
   branch on values fails as before, with the error naming the line.
"""
from __future__ import annotations

import ast
import contextlib
import copy
import functools
import inspect
import itertools
import math
import operator
import os
import random
import re
import sys
import textwrap
import threading
import traceback
import types
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autofuse import caches
from autofuse.grad_ops import PASS_GRADIENT, is_grad_mode_call
from autofuse.graph import CHECKPOINT, PRODUCTS, ancestors, describe_node, floating, get_attr_value, graph_module, \
    program_module, relayout_as_eager
from autofuse.quiet import torch_internal_warnings

ROUTES = ("auto", "export", "symbolic_trace")

# Side-effect-only checks inserted by export; they pin dtypes and add fake users to nodes.
_DROPPED_TARGETS = {
    torch.ops.aten._assert_tensor_metadata.default,
}


class CaptureError(RuntimeError):
    """A model could not be captured. The message names the route(s), the failing construct and a hint."""

    def __init__(self, route: str, message: str, defaults_skipped: tuple = ()):
        super().__init__(message)
        self.route = route
        #: arguments the forward gives a default only outside compilation and the capture met as None
        #: (:func:`_default_skipped_when_compiling`): passing them as eager builds them lets the capture run
        self.defaults_skipped = tuple(defaults_skipped)


@dataclass
class Captured:
    """Result of :func:`capture`; see the module docstring for the graph form."""

    graph_module: fx.GraphModule
    route: str
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    training: bool = False
    state_updates: tuple = ()        # the model's buffers and parameters the forward updates in place (item 7)
    input_updates: tuple = ()        # the flat inputs' indices the forward updates in place (item 7)
    passed_inputs: tuple = ()        # those of them that required grad (leaves): read with it (_pass_trained_updates)
    attribute_updates: tuple = ()    # (module, attribute, value): plain attributes the forward sets, as it leaves them
    tied: bool = False               # flattened with caches.lengths_tied (sliding-window lengths written as sizes)

    def flatten_inputs(self, *args, **kwargs) -> list:
        with caches.tied_as(self.tied):
            leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            raise TypeError(f"inputs do not match the captured structure:\n got {spec}\n want {self.in_spec}")
        return leaves

    def unflatten_outputs(self, flat, inputs=None) -> Any:
        """The user's outputs. Given the flat ``inputs`` (after :meth:`update_state`), an output that is the new
        value of an input updated in place is that input, as eager returns it (a static cache's tensors keep
        their identity)."""
        flat = list(flat)
        user = flat[:len(flat) - self.n_updates]
        if inputs is not None and self.input_updates:
            new = flat[len(flat) - len(self.input_updates):]
            same = {id(v): inputs[i] for i, v in zip(self.input_updates, new)}
            user = [same.get(id(v), v) for v in user]
        return pytree.tree_unflatten(user, self.out_spec)

    @property
    def n_updates(self) -> int:
        """How many of the graph's outputs are new values of state, after the user's outputs."""
        return len(self.state_updates) + len(self.input_updates)

    def update_state(self, flat, model: torch.nn.Module, inputs=()) -> None:
        """Write the graph's trailing outputs into the buffers and parameters of ``model`` the forward updates in
        place (looked up by name at this call), then into the flat ``inputs`` it updates in place, as eager's
        forward leaves them. The write is not recorded by autograd, as eager's are not (BatchNorm updates its
        statistics inside its kernel, Gemma 3n clamps through ``.data``; an input updated in place never requires
        grad, capture refuses that): the graph read the old values where the forward read them, so its backward
        is eager's."""
        for m, k, v in self.attribute_updates:
            m.__dict__[k] = copy.deepcopy(v)
        if not self.n_updates:
            return
        flat = list(flat)
        values = flat[len(flat) - self.n_updates:]
        with torch.no_grad():
            for fqn, value in zip(self.state_updates, values):
                state_tensor(model, fqn).data.copy_(value)
            for i, value in zip(self.input_updates, values[len(self.state_updates):]):
                # through .data, as the state above: the graph's backward may have saved the input (a BatchNorm's
                # running statistics, which a Dynamo graph takes as inputs, are saved for its backward), and
                # eager's kernel updates it before autograd saves it, not after
                inputs[i].data.copy_(value)

    def __call__(self, *args, **kwargs):
        return self.unflatten_outputs(self.graph_module(*self.flatten_inputs(*args, **kwargs)))


def capture(model: torch.nn.Module, example_args=(), example_kwargs=None, route: str = "auto",
            sizes=None) -> Captured:
    """Capture ``model(*example_args, **example_kwargs)`` as an aten-level GraphModule (see module doc).
    ``sizes``: an :class:`autofuse.sizes.SizeFamilies`, whose symbolic exports serve the export route's
    signatures that differ from earlier ones only in sizes."""
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    if not isinstance(example_args, tuple):
        example_args = (example_args,)
    example_kwargs = dict(example_kwargs or {})
    routes = ("export", "symbolic_trace") if route == "auto" else (route,)
    if any(isinstance(x, torch.Generator) for x in pytree.tree_leaves((example_args, example_kwargs))):
        raise CaptureError(route, "capture failed: the call passes a torch.Generator, which a captured graph cannot "
                                  "take as an input (torch.export does not trace generators). hint: draw from torch's "
                                  "default generator (seeded with torch.manual_seed), or compile the model with "
                                  "torch.compile(model, backend='autofuse'), which takes generator arguments")
    dtensors = _dtensors(model, (example_args, example_kwargs))
    if dtensors:
        raise CaptureError(route, f"capture failed: {dtensors} DTensors (torch.distributed.tensor: parallelize_module "
                                  f"and fully_shard make a module's parameters DTensors), which autofuse cannot "
                                  f"capture (torch.export does not trace DTensor modules in this torch, and a fused "
                                  f"plan computes on plain tensors). hint: for tensor parallelism keep each rank's "
                                  f"shard as a plain parameter and write its collectives with "
                                  f"torch.distributed._functional_collectives (y = fc.all_reduce(F.linear(x, "
                                  f"w_shard), 'sum', group), as autofuse.tp_models does): autofuse fuses such matmul + "
                                  f"collective pairs into MC2 kernels on every rank (README, Several NPUs); for data "
                                  f"parallelism wrap the fused module in DistributedDataParallel")
    caches.prepare(model, example_args, example_kwargs)      # a KV cache in or out: a pytree node (autofuse.caches)
    python_state = _python_state(model)
    host_rng = _host_rng_state()
    try:
        with _dynamo_marks_set_aside((example_args, example_kwargs)), caches.lengths_tied(model) as tied:
            captured = _capture_routes(model, example_args, example_kwargs, route, routes, sizes)
        captured.tied = tied
        _check_product_dtypes(captured.graph_module, model, captured.route)
    except BaseException as e:
        _restore_python_state(python_state)
        # a trace that stopped short of the end may have drawn already (SpecAugment draws before the data-dependent
        # span count that stops export): the user's generators are put back all the same
        drawn = _host_rng_drawn(host_rng)
        failures = getattr(e, "failures", None)
        if failures is not None and not drawn and "torch.compile" in str(e):
            # the hint would send the user to torch.compile, which (by default) draws np.random's numbers from
            # torch's generator: find out whether the forward draws at all, past where the traces stopped
            drawn = _eager_host_draws(model, example_args, example_kwargs)
        if failures is not None and drawn:
            raise _capture_error(route, model, failures, drawn) from None
        raise
    changed = _restore_python_state(python_state)
    drawn = _host_rng_drawn(host_rng)
    if drawn:
        raise CaptureError(route, f"capture failed: {_host_draw_text(drawn)}")
    settable = all(not k.startswith("_") and v is not _GONE and plain_attribute(v) for _, _, k, v in changed)
    if changed and settable and not _changes_again(model, changed, example_args, example_kwargs, route, routes):
        # a forward that sets a plain attribute to a value it then keeps (Swin sets its shift to 0 where the
        # image is no larger than its window): the graph of this call, then the attribute set as eager's call
        # leaves it; the next call's plan guard sees the new value and plans again from it
        captured.attribute_updates = tuple((m, k, v) for _, m, k, v in changed)
        return captured
    hooked = _recomputing_hooks(model, changed)
    if hooked:
        raise CaptureError(route, f"capture failed: {'; '.join(hooked)}: a forward pre-hook that sets a parameter "
                                  f"at each call, which a captured graph cannot do (it would keep the tensor the "
                                  f"capture saw; the attributes are restored). hint: make pruning permanent with "
                                  f"torch.nn.utils.prune.remove(module, name) before fuse(), and use "
                                  f"torch.nn.utils.parametrizations.weight_norm / spectral_norm instead of the legacy "
                                  f"torch.nn.utils.weight_norm / spectral_norm (a parametrization is traced into the "
                                  f"graph), or remove_weight_norm / remove_spectral_norm once trained")
    if changed:
        # a tensor the forward keeps in a new attribute may be built once, at the first call, and kept (transformers'
        # LongRoPE keeps its long_inv_freq so): one eager call before fuse() leaves it built, and a capture from
        # there changes nothing
        lazy = any(v is not _GONE and holds_tensor(v) and _attributes_before(python_state, m).get(k) is None
                   for _, m, k, v in changed)
        changed = [text for text, *_ in changed]
        raise CaptureError(route, f"capture failed: the forward changes the Python attribute(s) "
                                  f"{', '.join(changed)} of the model{' at every call' if settable else ''}, which a "
                                  f"captured graph cannot do at each call "
                                  f"(it would keep the value the capture saw; the attributes are restored). hint: keep "
                                  f"such state in a registered buffer updated in place (self.register_buffer('step', "
                                  f"torch.zeros((), dtype=torch.long)); self.step += 1): its new value is written "
                                  f"back after every fused call; return a tensor the caller reads (attention "
                                  f"weights kept for inspection) as one more output of the forward; or compile it "
                                  f"as it is with torch.compile(model, backend='autofuse'): Dynamo replays "
                                  f"attribute updates after each graph."
                                  + (" If the forward builds such a tensor once, at its first call, and keeps it "
                                     "(a lazily built table), run the model once eagerly before fuse(): the capture "
                                     "then reads it as kept." if lazy else ""))
    return captured


def _host_rng_state():
    """The host random generators a forward may draw from in Python (:func:`_host_rng_drawn`)."""
    return random.getstate(), np.random.get_state()


def _host_rng_drawn(before) -> str | None:
    """Which of Python's and numpy's global random generators moved since :func:`_host_rng_state` gave ``before``
    (put back as it was), in words; None if neither did."""
    (py, (kind, keys, pos, gauss, cached)), now = before, _host_rng_state()
    moved = []
    if now[0] != py:
        random.setstate(py)
        moved.append("Python's random module")
    if now[1][0] != kind or not np.array_equal(now[1][1], keys) or now[1][2:] != (pos, gauss, cached):
        np.random.set_state(before[1])
        moved.append("numpy's global random generator (np.random)")
    return " and ".join(moved) or None


def _host_draw_text(drawn: str) -> str:
    """Why a forward that draws from ``drawn`` (:func:`_host_rng_drawn`) cannot be captured, and what to do instead,
    torch.compile included only as it runs such a draw (both refusals of such a forward say this)."""
    text = (f"the forward draws from {drawn} in Python (the state is put back), which a captured graph cannot do at "
            f"each call: it would keep the values this capture drew, the same at every call (transformers' "
            f"SpecAugment time and feature masks in training, mask_time_prob / mask_feature_prob > 0, are drawn so). "
            f"hint: draw them outside the forward and pass them in (Wav2Vec2Model and its kin take "
            f"mask_time_indices=), set their probabilities to 0, or draw with torch (torch.rand, torch.bernoulli), "
            f"which the graph draws again at each call")
    if "numpy" in drawn:
        # Dynamo traces np.random's functions into its graph as torch ops drawing from torch's generator unless
        # this flag is set; with it, it breaks the graph at each draw and numpy makes it, as in eager
        return text + ("; torch.compile(model, backend='autofuse') runs such a forward as eager does only with "
                       "torch._dynamo.config.use_numpy_random_stream = True set before its first call: by default "
                       "Dynamo draws np.random's numbers from torch's generator, other numbers than eager's")
    # Dynamo makes Python's random draws in Python, before its graph or in a graph break, as eager makes them
    return text + "; or compile it with torch.compile(model, backend='autofuse'), which makes such draws as eager does"


def _eager_host_draws(model, example_args, example_kwargs) -> str | None:
    """Which of Python's and numpy's global generators one eager call of the forward draws from (in words, as
    :func:`_host_rng_drawn`), or None if neither does or the call cannot be made here (meta inputs, a graph Dynamo
    or torch.export made, inputs that cannot be copied, a forward that raises). The call changes nothing of the
    user's: it runs without grad on copies of the inputs, and the model's parameters and buffers (values, objects,
    requires_grad), its modules' attributes and modes, and torch's, numpy's and Python's generators are put back
    as they were."""
    from torch._subclasses.fake_tensor import FakeTensor
    state = [*model.parameters(), *model.buffers()]
    leaves = pytree.tree_leaves((example_args, example_kwargs))
    tensors = [t for t in [*leaves, *state] if isinstance(t, torch.Tensor)]
    if _dynamo_graph(model) or program_module(model) or torch.compiler.is_compiling() or \
            any(t.device.type == "meta" or isinstance(t, FakeTensor) for t in tensors):
        return None

    def copied(x):
        if not isinstance(x, torch.Tensor):
            return x
        c = x.detach().clone()
        return c.requires_grad_(x.requires_grad) if x.requires_grad and x.is_leaf else c
    try:
        # the forward may update an input in place (a static KV cache): it runs on copies
        args, kwargs = pytree.tree_map(copied, (example_args, example_kwargs))
    except Exception:  # noqa: BLE001 - an input pytree cannot rebuild: no call, the message stays as it was
        return None
    modules = list(model.modules())
    slots = [(m, dict(m._parameters), dict(m._buffers), m.training) for m in modules]
    saved = [(t, t.detach().clone(), t.requires_grad) for t in dict.fromkeys(state)]
    python_state = _python_state(model)
    host = _host_rng_state()
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    ran = False
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(*args, **kwargs)
        ran = True
    except Exception:  # noqa: BLE001 - a forward that raises here (on these inputs, or without grad) tells nothing
        pass
    finally:
        moved = _host_rng_drawn(host)             # puts the host generators back
        _restore_python_state(python_state)
        for m, params, buffers, training in slots:
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)
            m.training = training
        with torch.no_grad():
            for t, value, requires_grad in saved:
                if t.shape != value.shape or t.dtype != value.dtype:
                    t.data = value
                elif not torch.equal(t, value):
                    t.data.copy_(value)        # through .data: the update is the probe's, not autograd's
                if t.requires_grad != requires_grad:
                    t.requires_grad_(requires_grad)
    return moved if ran else None


def _recomputing_hooks(model, changed) -> list:
    """For each attribute in ``changed`` (:func:`_restore_python_state`) that a forward pre-hook of torch's
    recomputes at each call (``torch.nn.utils.prune``, the legacy ``weight_norm`` / ``spectral_norm``), what sets
    it, in words."""
    from torch.nn.utils.prune import BasePruningMethod
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm
    names = {id(m): name for name, m in model.named_modules()}
    out = []
    for _, m, k, _ in changed:
        for hook in m._forward_pre_hooks.values():
            if isinstance(hook, (BasePruningMethod, WeightNorm, SpectralNorm)) and getattr(hook, "_tensor_name",
                                                                                            getattr(hook, "name", k)) == k:
                where = names.get(id(m), "")
                out.append(f"{where + '.' if where else ''}{k} is recomputed by the forward pre-hook "
                           f"{type(hook).__module__}.{type(hook).__name__}")
                break
    return out


@contextlib.contextmanager
def _dynamo_marks_set_aside(inputs):
    """The inputs without the marks ``torch._dynamo.mark_dynamic`` (and its kin) set on a tensor, put back after:
    torch.export reads them as dims to keep symbolic, but a plan is made at the call's concrete sizes (a graph
    that must serve other sizes is planned again at each, :mod:`autofuse.sizes` sharing the export)."""
    marked = []
    for t in pytree.tree_leaves(inputs):
        if isinstance(t, torch.Tensor):
            marks = {k: v for k, v in vars(t).items() if k.startswith("_dynamo_") or
                     k in ("_has_dynamo_dim_marking", "_specialize_on")}
            for k in marks:
                delattr(t, k)
            marked.append((t, marks))
    try:
        yield
    finally:
        for t, marks in marked:
            for k, v in marks.items():
                setattr(t, k, v)


def _changes_again(model, changed, example_args, example_kwargs, route, routes) -> bool:
    """Whether the forward, captured again from the attribute values a first capture left (``changed``), changes
    any attribute again (``self.step += 1`` does; a forward that only settles a value does not). The model is left
    as it was."""
    originals = [(m, k, m.__dict__.get(k, _GONE)) for _, m, k, _ in changed]
    for _, m, k, v in changed:
        m.__dict__[k] = copy.deepcopy(v)
    state = _python_state(model)
    try:
        _capture_routes(model, example_args, example_kwargs, route, routes, None)
        return bool(_restore_python_state(state))
    except Exception:     # noqa: BLE001 - not capturable from there: treated as a change (the refusal follows)
        _restore_python_state(state)
        return True
    finally:
        for m, k, v in originals:
            if v is _GONE:
                m.__dict__.pop(k, None)
            else:
                m.__dict__[k] = v


def _capture_routes(model, example_args, example_kwargs, route, routes, sizes) -> Captured:
    failures = []
    for r in routes:
        try:
            kept = frozenset()      # the custom autograd.Functions kept whole (the second trace, if any)
            while True:
                with torch_internal_warnings(), _custom_functions(kept) as functions, _grad_blocks(), \
                        _checkpoints() as (checkpoints, grad_free_checkpoints), _fake_tensor_errors_unlogged(), \
                        _eager_autograd_reads() as reads, _eager_dropout(), _torch_transformers_as_eager(), \
                        _overflow_clamps(), _grad_mode_calls_inert():
                    if r == "export":
                        export = (None if sizes is None else
                                  lambda m, a, k: sizes.export(m, a, k, _export_functional))
                        gm, in_spec, out_spec = _capture_export(model, example_args, example_kwargs, export)
                    else:
                        gm, in_spec, out_spec = _capture_symbolic_trace(model, example_args, example_kwargs)
                differing = _custom_backwards(model, functions, (example_args, example_kwargs))
                if not differing or kept or r != "export":
                    break
                # traced again with each such Function one op that applies it (its own backward at run time)
                kept = frozenset(differing)
            if differing:
                _refuse_custom_backwards(differing)
            _detach_grad_free_blocks(gm)
            passed = _pass_trained_updates(gm, model)
            _cleanup(gm)
            relayout_as_eager(gm)      # a BatchNorm's output as eager's CPU kernel lays it out: dropouts draw by it
            _specialise_data_dependent(gm, r, pytree.tree_leaves((example_args, example_kwargs)))
            gm.meta["autofuse_training"] = model.training      # read by plans (an epilogue saves its product)
            gm.meta["autofuse_grad"] = torch.is_grad_enabled()  # canonicalize drops detach only without grad
            # traced through (without grad, or checked to be their forward's derivative) or kept whole, and those a
            # capture served from a symbolic export applied when that export was traced (it does not run the forward)
            gm.meta["autofuse_custom_functions"] = tuple(dict.fromkeys(
                [f.__qualname__ for f, _, _ in functions] + [f.__qualname__ for f in kept] +
                list(gm.meta.pop("autofuse_served_functions", ()))))
            # activation checkpoints traced through (a Dynamo graph's operator runs torch's checkpoint too; its
            # nodes are marked before the capture, mark_grad_blocks)
            gm.meta["autofuse_checkpoints"] = len(checkpoints)
            # reentrant ones without an input that requires grad: no gradient through them, as in eager (a Dynamo
            # graph's are marked before its capture, mark_grad_blocks)
            gm.meta["autofuse_grad_free_checkpoints"] = len(grad_free_checkpoints) + (
                model.meta.get("autofuse_grad_free_checkpoints", 0) if isinstance(model, fx.GraphModule) else 0)
            gm.meta["autofuse_autograd_reads"] = tuple(dict.fromkeys(reads))     # the plan's key holds that state
            return Captured(gm, r, in_spec, out_spec, training=model.training,
                            state_updates=gm.meta.get("autofuse_state_updates", ()),
                            input_updates=gm.meta.get("autofuse_input_updates", ()), passed_inputs=passed)
        except CaptureError:
            raise
        except Exception as e:  # noqa: BLE001 - every tracer failure becomes a CaptureError below
            failures.append((r, e))
    quantized = _quantized_layers(model)
    if quantized:
        # the tracers' own errors name a torchbind class or a quantized backend, not the layers or what to do
        raise CaptureError(route, _quantized_explanation(model, quantized, failures))
    error = _capture_error(route, model, failures)
    error.failures = failures       # capture() explains them again if the forward draws from a host generator
    raise error


def _python_state(model) -> list:
    """The model's modules' own attributes as they are before capture (:func:`_restore_python_state` puts them
    back): (module name, module, a shallow copy of its ``__dict__`` without parameters, buffers and submodules,
    a copy of each list's or dict's contents)."""
    state = []
    for name, m in model.named_modules():
        before = {k: v for k, v in vars(m).items() if k not in _STRUCTURE}
        contents = {k: (dict(v) if isinstance(v, dict) else list(v)) for k, v in before.items()
                    if isinstance(v, (list, dict)) and not k.startswith("_")}
        state.append((name, m, before, contents))
    return state


def public_attributes(m: torch.nn.Module):
    """A module's own attributes a forward may read as values: not private (``_name``), not ``training`` (a
    plan's key), not parameters, buffers or submodules (those live in ``_parameters`` and the like)."""
    return [(k, v) for k, v in vars(m).items() if not k.startswith("_") and k != "training"]


_PLAIN = (bool, int, float, str, type(None))
#: what a module keeps in its ``__dict__`` that is not an attribute a forward sets: its parameters, buffers and
#: submodules (their changes are state the graph writes back), and its mode (a plan's key)
_STRUCTURE = frozenset({"_parameters", "_buffers", "_modules", "training"})


def plain_attribute(v) -> bool:
    """A value capture reads into the graph as a constant: a number, string, flag or None, or a tuple, list or
    dict (with string keys) of them."""
    if isinstance(v, dict):
        return all(isinstance(k, str) and isinstance(x, _PLAIN) for k, x in v.items())
    return isinstance(v, _PLAIN) or (isinstance(v, (tuple, list)) and all(isinstance(x, _PLAIN) for x in v))


def holds_tensor(v) -> bool:
    """Whether ``v`` is a tensor or a container (pytree) holding one."""
    return any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(v))


def same_value(a, b) -> bool:
    """``a`` and ``b`` are the same value: the same object, equal plain values (NaN equals NaN), lists, tuples and
    dicts of the same values (torch's tracer may re-wrap a container), or equal values of one type that compares by
    value (a dtype, a device); two tensors only when they are one."""
    if a is b:
        return True
    if type(a) is not type(b) or isinstance(a, torch.Tensor):
        return False
    if isinstance(a, float):        # -0.0 is not 0.0 (x / s, copysign tell them apart); NaN is NaN
        return a.hex() == b.hex() or (a != a and b != b)
    if isinstance(a, _PLAIN):
        return a == b or (a != a and b != b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value without a plain equality is the same only as itself
        return False


def _shown(v) -> str:
    """An attribute's value in a message: a tensor by its shape and dtype (the traced one is a functional
    tensor, whose repr raises), a container holding tensors by its type and length."""
    if isinstance(v, torch.Tensor):
        return f"a tensor {list(v.shape)} {str(v.dtype).removeprefix('torch.')}"
    if holds_tensor(v):
        return f"a {type(v).__name__} of {len(v)} holding tensors" if hasattr(v, "__len__") else \
            f"a {type(v).__name__} holding tensors"
    return repr(v)


def _attributes_before(state, module) -> dict:
    """The attributes ``module`` had when :func:`_python_state` recorded ``state``."""
    return next((before for _, m, before, _ in state if m is module), {})


def _restore_python_state(state) -> list:
    """Put back what the forward changed of the modules' attributes while it was traced (:func:`_python_state`)
    and return the changes: ``(in words, module, attribute, the value the trace left)`` (``_GONE``: deleted).
    Public attributes are compared by value (a list or dict also by its contents); private ones (``_name``) and
    attributes the trace added are changes only where they hold a tensor (torch's own bookkeeping sets private
    values of its own)."""
    changed = []
    for name, m, before, contents in state:
        now = vars(m)
        where = f"{name}." if name else ""
        for k in [k for k in now if k not in before and k not in _STRUCTURE]:
            if not k.startswith("_") or holds_tensor(now[k]):
                v = now.pop(k)
                changed.append((f"{where}{k} (new: {_shown(v)})", m, k, v))
        for k, v in before.items():
            cur = now.get(k, _GONE)
            was = contents.get(k, v)
            if cur is _GONE:
                changed.append((f"{where}{k} (deleted)", m, k, _GONE))
            elif k.startswith("_"):
                if cur is v or not (holds_tensor(cur) or holds_tensor(v)):
                    continue
                if not _parameter_cache(m, k):
                    changed.append((f"{where}{k} ({_shown(v)} -> {_shown(cur)})", m, k, cur))
            elif same_value(cur, was):
                now[k] = v           # the user's own object put back (a re-wrapped container)
                continue
            else:
                left = copy.deepcopy(cur) if plain_attribute(cur) else cur     # before a list is put back in place
                changed.append((f"{where}{k} ({_shown(was)} -> {_shown(cur)})", m, k, left))
            if k in contents:
                if isinstance(v, list):
                    v[:] = contents[k]
                else:
                    v.clear()
                    v.update(contents[k])
            now[k] = v
    return changed


_GONE = object()


def _parameter_cache(m: torch.nn.Module, k: str) -> bool:
    """Whether ``m.k`` is torch's own list of ``m``'s parameters, which its forward rebuilds from them when they are
    other tensors than the list holds: an RNN's ``_flat_weights``. The trace reads the parameters as traced values,
    so the forward rebuilt it from those; put back, eager's next call finds its parameters in it as before."""
    return k == "_flat_weights" and isinstance(m, torch.nn.RNNBase)


#: the custom autograd.Functions the capture running on this thread has applied so far, by name (_custom_functions)
_APPLIED = threading.local()


def custom_functions_applied() -> tuple:
    """The names of the custom autograd.Functions the forward applied in the capture running on this thread so far
    (() outside one): what a size family's symbolic export records for the captures it serves, which do not run the
    forward."""
    return tuple(getattr(_APPLIED, "names", ()))


@contextlib.contextmanager
def _custom_functions(kept=frozenset()):
    """The user's ``torch.autograd.Function`` classes the forward applies while it is captured (a list filled in
    place, with each one's first call's arguments as :func:`_shapes`). Capture traces their forward; their backward
    is not in the graph. A class in ``kept`` is applied as one ``autofuse_grad::user_function`` op instead, which
    applies the Function itself when the graph runs (:func:`_keep_application`); one that cannot be kept so is
    traced and listed as the others."""
    seen: list = []
    applied = _APPLIED.names = []       # every application's class name, for a size family (custom_functions_applied)
    Function = torch.autograd.function.Function
    own = Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if getattr(_KEEPING, "depth", 0):
            # inside a kept Function's forward (its fake run): not the graph's, nothing to see
            return own.__func__(cls, *args, **kwargs)
        user = not (cls.__module__ or "").startswith("torch")
        if user:
            applied.append(cls.__qualname__)
        if cls in kept:
            reads = getattr(_READS, "reads", None)
            if isinstance(reads, list):
                # kept whole because the call is differentiated: a read of autograd state, so the plan is keyed by
                # that state and a size family's symbolic export (autofuse.sizes) does not serve its other sizes (a
                # served capture does not run the forward: the Function would be neither seen nor kept)
                reads.append(f"a custom autograd.Function kept whole ({cls.__qualname__})")
            try:
                return _keep_application(cls, args, kwargs, sys._getframe(1))
            except NotKeepable:
                pass
        if user and all(c is not cls for c, _, _ in seen):
            seen.append((cls, _shapes(args), _shapes(kwargs)))
        return own.__func__(cls, *args, **kwargs)
    Function.apply = classmethod(apply)
    try:
        yield seen
    finally:
        _APPLIED.names = ()
        Function.apply = own


def _checkpointed(fn):
    """What a checkpoint runs, the same for each trace of the forward: transformers' layers checkpoint a new
    ``partial`` of their forward and themselves at each call (``partial(forward, self, **kwargs)``)."""
    bound = []
    while isinstance(fn, functools.partial):
        bound += [id(a) for a in fn.args]
        fn = fn.func
    if getattr(fn, "__self__", None) is not None and hasattr(fn, "__func__"):      # a bound method
        bound.append(id(fn.__self__))
        fn = fn.__func__
    if getattr(fn, "__closure__", None):
        # a closure made at each call (torch's checkpoint operator in a Dynamo graph wraps its body so, a lambda
        # around a block): its code and the modules and functions it closes over
        bound += [id(c.cell_contents) for c in fn.__closure__
                  if isinstance(getattr(c, "cell_contents", None), (torch.nn.Module, types.FunctionType))]
        return id(fn.__code__), tuple(bound)
    return id(fn), tuple(bound)


@contextlib.contextmanager
def _checkpoints():
    """The functions the forward checkpoints (``torch.utils.checkpoint.checkpoint``, reentrant or not) while it
    is captured: a set of their ids, filled in place (a trace may run the forward more than once). The trace runs
    a checkpointed function as a plain call and marks the nodes each call makes (:data:`CHECKPOINT`, numbered by
    call): a plan made with grad runs them through torch's checkpoint again (:mod:`autofuse.checkpointing`). A
    reentrant checkpoint (``use_reentrant=True``, torch's ``CheckpointFunction``) called with
    grad where none of its tensor inputs would require grad in eager (followed by :func:`_eager_autograd_reads`)
    gives outputs without a gradient in eager, and the parameters it uses get none from them: its function is
    traced as the forward's own ``torch.no_grad()`` block (:data:`GRAD_BLOCK`, detached where read outside,
    :func:`_detach_grad_free_blocks`), and the ids of such checkpoints are the second set yielded (the plan warns
    of them, as eager warns at each call). Whether its inputs require grad is recorded as a read of autograd state:
    the plan serves only calls in the same state. torch's own warning that no input requires grad (the trace runs
    without grad) is silenced."""
    from torch.utils import checkpoint as ckpt
    functions: set = set()
    grad_free: set = set()
    calls = itertools.count()
    opened: list = []          # the marks of non-reentrant checkpoints, closed at the end if a trace stopped inside
    reentrant = ckpt.CheckpointFunction.forward
    generator = ckpt._checkpoint_without_reentrant_generator
    capturing = threading.get_ident()      # another thread's checkpoints (a model trained beside) are not counted

    def forward(ctx, run_function, *args):
        if threading.get_ident() != capturing:
            return reentrant(ctx, run_function, *args)
        fn = _checkpointed(run_function)
        functions.add(fn)
        state = getattr(_READS, "state", None)
        if state is None:
            return reentrant(ctx, run_function, *args)
        grad, requires = state
        if not grad():                          # made without grad in eager too
            return reentrant(ctx, run_function, *args)
        _READS.reads.append("a reentrant checkpoint's inputs' requires_grad")
        if any(requires(a) for a in args if isinstance(a, torch.Tensor)):
            with _marked_checkpoint(calls):
                return reentrant(ctx, run_function, *args)
        grad_free.add(fn)
        with _marked_grad_mode(False):          # eager's CheckpointFunction: no gradient through its outputs
            return reentrant(ctx, run_function, *args)

    def without_reentrant(fn, *args, **kwargs):
        if threading.get_ident() != capturing:
            return generator(fn, *args, **kwargs)
        functions.add(_checkpointed(fn))

        def marked():
            # torch's checkpoint runs the function between this generator's first and second step
            with _marked_checkpoint(calls):
                yield from generator(fn, *args, **kwargs)
        opened.append(marked())
        return opened[-1]
    ckpt.CheckpointFunction.forward = staticmethod(forward)
    ckpt._checkpoint_without_reentrant_generator = without_reentrant
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="None of the inputs have requires_grad=True",
                                    category=UserWarning)
            yield functions, grad_free
    finally:
        ckpt.CheckpointFunction.forward = staticmethod(reentrant)
        ckpt._checkpoint_without_reentrant_generator = generator
        for g in reversed(opened):
            g.close()


@contextlib.contextmanager
def _marked_grad_mode(mode: bool):
    """The nodes the tracer makes inside carry ``mode`` as :data:`GRAD_BLOCK`, as in one of the forward's own
    grad-mode blocks (:func:`_grad_blocks`); the tracer's metadata is put back as it was on exit."""
    from torch.fx import traceback as fx_traceback
    with fx_traceback.preserve_node_meta():
        meta = fx_traceback.current_meta
        fx_traceback.current_meta = {**meta, "custom": {**(meta.get("custom") or {}), GRAD_BLOCK: mode}}
        yield


#: the key of ``node.meta["custom"]`` that holds the grad mode of the forward's own block the node was made in
GRAD_BLOCK = "autofuse_grad"


@contextlib.contextmanager
def _marked_checkpoint(calls):
    """The nodes the tracer makes inside carry the next number of ``calls`` as :data:`CHECKPOINT`, unless they are
    inside a checkpoint already (the outer one recomputes the inner); the tracer's metadata is put back on exit."""
    from torch.fx import traceback as fx_traceback
    if CHECKPOINT in (fx_traceback.current_meta.get("custom") or {}):
        yield
        return
    with fx_traceback.preserve_node_meta():
        meta = fx_traceback.current_meta
        fx_traceback.current_meta = {**meta, "custom": {**(meta.get("custom") or {}), CHECKPOINT: next(calls)}}
        yield


@contextlib.contextmanager
def _grad_blocks():
    """While the forward is captured, every node made inside one of its own ``with torch.no_grad():``,
    ``torch.enable_grad()``, ``torch.set_grad_enabled(mode)`` or ``torch.inference_mode()`` blocks (or a method
    decorated with one) carries that block's mode as ``node.meta["custom"][GRAD_BLOCK]``: the tracer copies
    ``torch.fx.traceback.current_meta["custom"]`` into the nodes it makes while node metadata is preserved, which
    is only inside such a block, so the rest of the graph is made as before. The trace itself runs without grad,
    so the mode is recorded from the blocks, not read. The blocks of torch's machinery (not torch.nn's modules and
    functions, which are the forward's: :func:`_forwards_block`) are left alone."""
    from torch.autograd import grad_mode
    from torch.fx import traceback as fx_traceback
    # inference_mode(): no gradient through what the block makes, as no_grad (eager's values made there are
    # inference tensors, read outside through a copy with no history); inference_mode(False) is not a block
    modes = {grad_mode.no_grad: lambda block: False, grad_mode.enable_grad: lambda block: True,
             grad_mode.set_grad_enabled: lambda block: bool(block.mode),
             grad_mode.inference_mode: lambda block: False if block.mode else None}
    own = {cls: (cls.__dict__["__enter__"], cls.__dict__["__exit__"]) for cls in modes}
    open_blocks: dict[int, list] = {}
    capturing = threading.get_ident()

    def mark(block, mode, frame):
        # the patch is the process's: another thread's blocks (a model run eagerly beside the capture) are not
        # this forward's, and must not touch the tracer's metadata, which is the process's too
        if mode is not None and threading.get_ident() == capturing and _forwards_block(frame):
            marks = fx_traceback.preserve_node_meta()       # puts the metadata back as it was on exit
            marks.__enter__()
            # new dicts, never an edit in place: an enclosing context of torch's may hold the dict it
            # replaces (set_current_meta keeps it to put back), and would put back the edit with it
            meta = fx_traceback.current_meta
            fx_traceback.current_meta = {**meta, "custom": {**(meta.get("custom") or {}), GRAD_BLOCK: mode}}
            open_blocks.setdefault(id(block), []).append(marks)

    # torch.set_grad_enabled(mode) sets the mode when it is made: called as a plain function, it marks from there
    # on (until the next such call, or the end of the capture); as a block, its __enter__ adds no second mark
    set_init = grad_mode.set_grad_enabled.__init__

    def __init__(block, mode):
        set_init(block, mode)
        mark(block, bool(mode), sys._getframe(1))

    def patched(cls):
        enter, exit_ = own[cls]

        def __enter__(block):
            result = enter(block)
            if not (cls is grad_mode.set_grad_enabled and id(block) in open_blocks):
                mark(block, modes[cls](block), sys._getframe(1))
            return result

        def __exit__(block, *exc):
            marks = open_blocks.get(id(block))
            if marks:
                marks.pop().__exit__(None, None, None)
                if not marks:
                    del open_blocks[id(block)]
            return exit_(block, *exc)
        return __enter__, __exit__

    preserving = fx_traceback.should_preserve_node_meta
    for cls in modes:
        cls.__enter__, cls.__exit__ = patched(cls)
    grad_mode.set_grad_enabled.__init__ = __init__
    try:
        yield
    finally:
        for cls, (enter, exit_) in own.items():
            cls.__enter__, cls.__exit__ = enter, exit_
        grad_mode.set_grad_enabled.__init__ = set_init
        # nothing of a block's mark outlives the capture (a block left open by a trace that stopped inside it, a
        # set_grad_enabled called as a function), closed last opened first
        for marks in reversed(list(open_blocks.values())):
            for m in reversed(marks):
                m.__exit__(None, None, None)
        fx_traceback.should_preserve_node_meta = preserving
        meta = fx_traceback.current_meta
        if GRAD_BLOCK in (meta.get("custom") or {}):
            custom = {k: v for k, v in meta["custom"].items() if k != GRAD_BLOCK}
            fx_traceback.current_meta = {**{k: v for k, v in meta.items() if k != "custom"},
                                         **({"custom": custom} if custom else {})}


#: The forward's reads of autograd state in the capture running on this thread (:func:`_eager_autograd_reads`).
_READS = threading.local()


def autograd_reads() -> int:
    """How many times the forward has read autograd state (``tensor.requires_grad``, ``torch.is_grad_enabled()``)
    in the capture running on this thread so far; 0 outside one."""
    return len(getattr(_READS, "reads", ()))


#: Functions whose tensor outputs never carry a gradient in eager, whatever their inputs.
_NO_GRADIENT = frozenset({"detach", "detach_", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like",
                          "randn_like", "randint_like", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"})


def _tensors(x):
    """The tensors in a call's arguments or results (tuples, lists and dicts of them): pytree's flattening is a
    third of a capture's time when run at every op."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)


@contextlib.contextmanager
def _eager_autograd_reads():
    """While the forward is captured, its own reads of autograd state give what they give in eager: the trace runs
    without grad, so ``h.requires_grad`` would read False for a value computed from parameters, and
    ``torch.is_grad_enabled()`` False, and a branch on either would take eager's no-grad path into a graph that
    then serves calls with grad. A torch-function mode follows, op by op, whether each value the forward makes
    would require grad in eager (the caller's grad mode, or the forward's own block's, and any input that
    requires it; a floating result; an in-place update adds its source's), and answers the forward's reads from
    that; torch's own reads get the trace's values. Each read is recorded (:func:`autograd_reads`): a plan whose
    forward read autograd state is kept for calls in the same autograd state (``autofuse.engine``). A tensor hook
    registered by the forward (``h.register_hook``) is refused by name: a captured graph keeps none."""
    from torch.fx import traceback as fx_traceback
    from torch.overrides import TorchFunctionMode

    caller = torch.is_grad_enabled()
    capturing = threading.get_ident()
    descriptor = torch._C.TensorBase.__dict__["requires_grad"]
    data = torch._C.TensorBase.__dict__["data"]
    made: dict = {}                     # id(tensor) -> (tensor, whether eager's would require grad)
    in_place_names: dict = {}           # function name -> whether it updates its first argument in place
    reads: list = []
    own_is_grad_enabled = torch._C.is_grad_enabled

    def eager_mode() -> bool:
        mark = (fx_traceback.current_meta.get("custom") or {}).get(GRAD_BLOCK)
        return caller if mark is None else mark

    def requires(t) -> bool:
        entry = made.get(id(t))
        return entry[1] if entry is not None and entry[0] is t else bool(descriptor.__get__(t))

    def mark(t, flag: bool) -> None:
        made[id(t)] = (t, flag)     # the tensor held, so that its id stays its own while the capture runs

    def reader(frame):
        # the frame that read or called (:func:`_calling_frame`), on the capturing thread only
        return _calling_frame(frame) if threading.get_ident() == capturing else None

    def forwards(frame) -> bool:
        return reader(frame) is not None

    def is_grad_enabled():
        if forwards(sys._getframe(1)):
            reads.append("torch.is_grad_enabled()")
            return eager_mode()
        return own_is_grad_enabled()

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            owner, name = getattr(func, "__self__", None), getattr(func, "__name__", "")
            if owner is descriptor and name == "__get__" and forwards(sys._getframe(1)):
                reads.append("tensor.requires_grad")
                return requires(args[0])
            frame = reader(sys._getframe(1)) if name == "register_hook" else None
            if frame is not None:
                raise CaptureError("export", f"capture failed: the forward registers a tensor hook "
                                             f"(register_hook, at {frame.f_code.co_filename}:{frame.f_lineno}), "
                                             f"which a captured graph does not keep. hint: compile the model with "
                                             f"torch.compile(model, backend='autofuse') (Dynamo keeps tensor "
                                             f"hooks), or run it eagerly.")
            out = func(*args, **kwargs)
            if threading.get_ident() != capturing:
                return out
            if owner is descriptor and name == "__set__":
                mark(args[0], bool(args[1]))
                return out
            if name == "requires_grad_":
                mark(args[0], bool(args[1] if len(args) > 1 else kwargs.get("requires_grad", True)))
                return out
            in_place = in_place_names.get(name)
            if in_place is None:
                in_place = in_place_names[name] = _in_place_name(name)
            in_place = in_place and args and isinstance(args[0], torch.Tensor)
            made_now = (out,) if isinstance(out, torch.Tensor) else tuple(_tensors(out))
            if not made_now and not in_place:       # most calls: a size, a dim, a flag
                return out
            given = list(_tensors((args, kwargs)))
            flows = eager_mode() and owner is not data and name not in _NO_GRADIENT and any(map(requires, given))
            if in_place:
                mark(args[0], flows or requires(args[0]))
            base = args[0] if args and isinstance(args[0], torch.Tensor) else None
            given = {id(t) for t in given}
            for t in made_now:
                if id(t) not in given:                  # not an input handed back
                    # a view of what requires grad requires it in any mode, as a factory asked to does (the
                    # trace's own flag says so for those it sees)
                    mark(t, floating(t) and (
                        flows or bool(descriptor.__get__(t)) or (base is not None and t._is_view() and requires(base))))
            return out

    def read(what, answer):
        reads.append(what)
        return answer

    _READS.reads = reads
    # eager's grad mode at this point of the forward and whether a tensor would require grad, not recorded as reads
    # (_checkpoints records what it reads)
    _READS.state = (eager_mode, requires)
    # for autofuse's own stand-ins of a forward's code (_torch_transformers_as_eager): eager's answers, recorded
    _READS.eager = (lambda: read("torch.is_grad_enabled()", eager_mode()),
                    lambda t: read("tensor.requires_grad", requires(t)))
    torch.is_grad_enabled = torch._C.is_grad_enabled = is_grad_enabled
    try:
        with Reads():
            yield reads
    finally:
        torch.is_grad_enabled = torch._C.is_grad_enabled = own_is_grad_enabled
        _READS.reads, _READS.eager, _READS.state = (), None, None


def _while_capturing(install):
    """A context manager that applies a process-wide stand-in while any capture runs: ``install()`` applies it and
    returns what undoes it. The captures running are counted under a lock, so captures on two threads that overlap
    and end in either order leave torch's own in place after both."""
    state = {"lock": threading.Lock(), "depth": 0, "undo": None}

    @contextlib.contextmanager
    def applied():
        with state["lock"]:
            if state["depth"] == 0:
                state["undo"] = install()
            state["depth"] += 1
        try:
            yield
        finally:
            with state["lock"]:
                state["depth"] -= 1
                if state["depth"] == 0:
                    state["undo"]()
    return applied


def _install_eager_dropout():
    """While the forward is captured, ``aten.dropout`` (``nn.Dropout``, ``F.dropout``) with p = 1 in training
    traces as eager runs it: ``input * 0``, no draw. torch's decomposition, which the trace applies, spells every
    training dropout with p != 0 as ``native_dropout``, and that draws a keep-mask (``bernoulli_(0)``) even at
    p = 1, where eager's ``dropout`` returns zeros without touching the generator: the captured graph (and every
    fusion of it) would move the generator past eager's, and each later random op would draw other numbers. An
    explicit ``native_dropout`` call draws at p = 1 in eager too and is traced as it is. The decomposition is
    the process's: put back on exit."""
    from torch._C import DispatchKey
    op = torch.ops.aten.dropout.default
    keys = [k for k in (DispatchKey.CompositeImplicitAutograd, DispatchKey.Autograd) if k in op.py_kernels]
    own = {k: op.py_kernels[k] for k in keys}

    def as_eager(decomposed):
        def dropout(input, p, train):
            if train and p == 1:
                return torch.ops.aten.mul.Tensor(input, 0)      # at::dropout's multiply by zero: NaN stays NaN
            return decomposed(input, p, train)
        return dropout

    for k in keys:
        op.py_kernels[k] = as_eager(own[k])
    op._dispatch_cache.clear()

    def undo():
        op.py_kernels.update(own)
        op._dispatch_cache.clear()
    return undo


_eager_dropout = _while_capturing(_install_eager_dropout)

#: torch's own functions that the stand-ins of :func:`_install_transformers_as_eager` call
_TORCH_OWN: dict = {}


def _install_transformers_as_eager():
    """While the forward is captured, torch's own ``nn.Transformer`` family computes what eager computes, where its
    code asks something a trace cannot answer the way eager does:

    * ``TransformerEncoder`` in eval with a ``src_key_padding_mask`` runs eager's nested-tensor path: each
      sequence is its first L tokens (L its unpadded count; a mask entry that is not 0 pads), attention runs
      among them alone, and the output is 0 at every other position (``to_padded_tensor(0.0)``, before the final
      norm). Under torch.export it takes the padded path instead. :func:`_encoder_forward` is torch's padded
      path given those L tokens and with those positions set to 0, wherever eager's own checks take the nested
      path (grad mode and ``requires_grad`` read as eager reads them, through the capture's autograd reads; the
      mask's left alignment, which eager checks on the data, as a value of the graph).
    * a ``mask`` given without ``is_causal`` (``nn.Transformer(src, tgt, tgt_mask=...)``, as torch's tutorial calls
      it) is compared with a causal mask to set a hint, data-dependent control flow torch.export refuses: the mask
      is used as given instead, which is what the hint would have picked between two equal computations.
    """
    from torch.nn.modules import transformer as tm
    own = tm.TransformerEncoder.forward, tm._detect_is_causal_mask
    _TORCH_OWN["forward"], _TORCH_OWN["detect"] = own
    tm.TransformerEncoder.forward, tm._detect_is_causal_mask = _encoder_forward, _detect_causal

    def undo():
        tm.TransformerEncoder.forward, tm._detect_is_causal_mask = own
    return undo


_torch_transformers_as_eager = _while_capturing(_install_transformers_as_eager)


def _detect_causal(mask, is_causal=None, size=None):
    if is_causal is None and mask is not None:
        return False
    return _TORCH_OWN["detect"](mask, is_causal, size)


def _encoder_forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
    from torch.nn.modules import transformer as tm
    padded = _nested_padding(self, src, mask, src_key_padding_mask)
    if padded is None:
        return _TORCH_OWN["forward"](self, src, mask, src_key_padding_mask, is_causal)
    first = self.layers[0]
    pad = padded != 0                               # the canonical mask: -inf (or any value but 0) where padded
    if getattr(self, "mask_check", True):
        # eager's nested path only for a left-aligned mask, where its first L tokens are the unpadded ones; any
        # other mask runs the padded path, the mask added as given
        keep = ~pad
        aligned = (keep[:, 1:] <= keep[:, :-1]).all()
        nested = pad
    else:                                           # taken unchecked: each sequence's first L tokens, whatever the mask
        aligned = None
        nested = torch.arange(pad.shape[-1], device=pad.device) >= (~pad).sum(-1, keepdim=True)
    dropped = torch.zeros_like(padded).masked_fill(nested, float("-inf"))
    layer_mask = dropped if aligned is None else torch.where(aligned, dropped, padded)
    is_causal = tm._detect_is_causal_mask(None, is_causal, tm._get_seq_len(src, first.self_attn.batch_first))
    output = src
    for mod in self.layers:
        output = mod(output, src_mask=None, is_causal=is_causal, src_key_padding_mask=layer_mask)
    rows = nested if aligned is None else nested & aligned
    rows = rows if first.self_attn.batch_first else rows.transpose(0, 1)
    output = output.masked_fill(rows.unsqueeze(-1), 0.0)
    return self.norm(output) if self.norm is not None else output


def _nested_padding(self, src, mask, src_key_padding_mask):
    """The canonical padding mask where eager's ``TransformerEncoder.forward`` would take its nested path (its
    checks in its order, but not ``torch.compiler.is_compiling()``), else None."""
    import torch.nn.functional as F
    kpm = F._canonical_mask(mask=src_key_padding_mask, mask_name="src_key_padding_mask",
                            other_type=F._none_or_dtype(mask), other_name="mask", target_type=src.dtype)
    mask = F._canonical_mask(mask=mask, mask_name="mask", other_type=None, other_name="",
                             target_type=src.dtype, check_other=False)
    first = self.layers[0]
    if (not torch.backends.mha.get_fastpath_enabled() or not getattr(self, "use_nested_tensor", False)
            or first.training or src.dim() != 3 or kpm is None or src.is_nested or mask is not None
            or torch.is_autocast_enabled()):
        return None
    attn = first.self_attn
    tensors = (src, attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight, attn.out_proj.bias,
               first.norm1.weight, first.norm1.bias, first.norm2.weight, first.norm2.bias,
               first.linear1.weight, first.linear1.bias, first.linear2.weight, first.linear2.bias)
    devices = ("cpu", "cuda", "xpu", torch.utils.backend_registration._privateuse1_backend_name)
    grad_enabled, requires_grad = getattr(_READS, "eager", None) or (torch.is_grad_enabled,
                                                                     lambda t: t.requires_grad)
    if src.device.type not in devices or (grad_enabled() and
                                          any(requires_grad(t) for t in tensors if t is not None)):
        return None
    return kpm


#: the conditions of the overflow-clamp idiom (:func:`_overflow_clamps`): (reduction, element test) -> the value of
#: the reduction for which the forward clamps (``not torch.isfinite(h).all()``: False; ``torch.isinf(h).any()``: True)
_CLAMP_CONDITIONS = {("all", "isfinite"): False, ("any", "isinf"): True}
_CLAMP_NAMES = frozenset({"__bool__", "item", "isfinite", "isinf", "all", "any", "clamp", "clip"})


@contextlib.contextmanager
def _overflow_clamps():
    """While the forward is captured, the float16 overflow clamp of transformers' encoder layers (BART, Marian, MVP,
    PLBart, LED, BigBird-Pegasus, NLLB-MoE, Informer, ...; the DETR family's in training; LongT5 and Pix2Struct
    spell the test with ``torch.isinf(h).any()``)::

        if hidden_states.dtype == torch.float16 and not torch.isfinite(hidden_states).all():
            clamp_value = torch.finfo(hidden_states.dtype).max - 1000
            hidden_states = torch.clamp(hidden_states, min=-clamp_value, max=clamp_value)

    branches on the values, which torch.export refuses (``GuardOnDataDependentSymNode``). It is captured as what it
    computes for any values, ``h = torch.where(torch.isfinite(h).all(), h, torch.clamp(h, ...))`` (``torch.where(
    torch.isinf(h).any(), torch.clamp(h, ...), h)``): the graph computes the test and takes eager's branch at each
    call, so the fused model clamps where eager clamps and leaves ``h`` as it is where eager does (an unconditional
    clamp would not: a finite value between ``max - 1000`` and ``max`` is clamped only where another overflowed).
    Gradients are eager's too: ``where`` passes the gradient of the branch it picks.

    Recognised by its source, not guessed: the ``bool()`` of a reduction over ``isfinite`` / ``isinf`` of a tensor
    ``h`` is answered only where the forward's frame is at the test of an ``if`` (its last ``and`` operand) spelled
    as above on the variable that holds ``h``, whose body (no ``else``) is assignments of other names from
    arithmetic, attributes and ``torch.finfo`` (names the function reads elsewhere only after assigning them
    itself), then ``h = torch.clamp(h, ...)`` (or ``torch.clip``). The trace then takes the branch and its clamp of
    ``h``, in that frame, returns the ``where``. Any other data-dependent test is left to torch.export, whose error
    capture reports as before. Nothing is patched: a torch-function mode of this capture's thread, left on exit."""
    from torch.overrides import TorchFunctionMode

    capturing = threading.get_ident()
    made: dict = {}         # id(result) -> (result, function name, its tensor) for isfinite / isinf / all / any
    pending: dict = {}      # id(h) -> (h, the test's reduction, its value where the forward clamps, the frame)

    def taken(t, frame):
        """The answer to ``bool(t)`` that takes the idiom's branch, where ``t`` is its test; else None."""
        reduced = made.get(id(t))
        tested = reduced and made.get(id(reduced[2]))
        if not reduced or reduced[0] is not t or not tested or tested[0] is not reduced[2]:
            return None
        key, h = (reduced[1], tested[1]), tested[2]
        frame = _calling_frame(frame)
        if key not in _CLAMP_CONDITIONS or frame is None:
            return None
        name = _overflow_clamp_name(frame, key)
        if name is None or frame.f_locals.get(name) is not h:
            return None
        pending[id(h)] = (h, t, _CLAMP_CONDITIONS[key], frame)
        return _CLAMP_CONDITIONS[key]

    class Clamps(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            if name not in _CLAMP_NAMES or threading.get_ident() != capturing or not args:
                return func(*args, **kwargs)
            if name in ("__bool__", "item"):
                # bool(t); a FunctionalTensor's __bool__ (the trace's values, straight to functional aten) is
                # bool(self.item())
                frame = sys._getframe(1) if name == "__bool__" else _in_functional_bool(sys._getframe(1))
                answer = None if frame is None else taken(args[0], frame)
                return func(*args, **kwargs) if answer is None else answer
            entry = pending.get(id(args[0])) if name in ("clamp", "clip") else None
            if entry is not None and entry[0] is args[0] and _calling_frame(sys._getframe(1)) is entry[3]:
                h = args[0]
                _, test, clamps_where, _ = pending.pop(id(h))
                clamped = func(*args, **kwargs)
                return torch.where(test, clamped, h) if clamps_where else torch.where(test, h, clamped)
            out = func(*args, **kwargs)
            if name in ("isfinite", "isinf", "all", "any") and len(args) == 1 and not kwargs and \
                    isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor):
                made[id(out)] = (out, name, args[0])        # held, so that its id stays its own while capturing
            return out

    try:
        with Clamps():
            yield
        if pending:
            h, _, _, frame = next(iter(pending.values()))
            raise CaptureError("export", f"capture failed: the float16 overflow clamp at {frame.f_code.co_filename}:"
                                         f"{frame.f_lineno} was recognised but its torch.clamp was not reached; "
                                         f"hint: compile the model with torch.compile(model, backend='autofuse')")
    finally:
        made.clear()
        pending.clear()


def _past_dispatch(frame):
    """``frame`` or the first frame that called it past torch-function dispatch (another mode's handler, torch's
    handle_torch_function and the Tensor method that called it)."""
    while frame is not None and (frame.f_code.co_name == "__torch_function__" or
                                 frame.f_code.co_filename in (_OVERRIDES, _TENSOR)):
        frame = frame.f_back
    return frame


def _calling_frame(frame):
    """The frame that called a torch function, past torch-function dispatch (:func:`_past_dispatch`); None where
    that is torch's or autofuse's."""
    frame = _past_dispatch(frame)
    if frame is None or os.path.abspath(frame.f_code.co_filename).startswith((_TORCH_DIR, _OWN_DIR)):
        return None
    return frame


def _in_functional_bool(frame):
    """Where a torch function was called by ``FunctionalTensor.__bool__`` (which calls ``self.item()``), the frame
    that called ``bool()``; else None."""
    frame = _past_dispatch(frame)
    if frame is None or frame.f_code.co_name != "__bool__" or frame.f_code.co_filename != _FUNCTIONAL_TENSOR:
        return None
    return frame.f_back


def _overflow_clamp_name(frame, key) -> str | None:
    """The variable that the overflow-clamp idiom (:func:`_overflow_clamps`) with the test ``key`` tests and clamps,
    where ``frame`` is at that idiom's test; None where it is not."""
    import ast
    if frame.f_globals.get("torch") is not torch:
        return None
    tree = _parsed(frame.f_code.co_filename, frame.f_globals)
    code = frame.f_code
    function = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name == code.co_name
                     and min(d.lineno for d in [n, *n.decorator_list]) == code.co_firstlineno), None) if tree else None
    tests = [n for n in ast.walk(function) if isinstance(n, ast.If)
             and n.test.lineno <= frame.f_lineno <= n.test.end_lineno] if function else []
    if len(tests) != 1 or tests[0].orelse:
        return None
    node = tests[0]

    def torch_call(n, names):
        return isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in names and \
            isinstance(n.func.value, ast.Name) and n.func.value.id == "torch"

    def tested(n):
        """``torch.<test>(N).<reduction>()`` or ``torch.<reduction>(torch.<test>(N))``: (reduction, test, N)."""
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and not n.args and not n.keywords \
                and torch_call(n.func.value, ("isfinite", "isinf")):
            inner, reduction = n.func.value, n.func.attr
        elif torch_call(n, ("all", "any")) and len(n.args) == 1 and not n.keywords and \
                torch_call(n.args[0], ("isfinite", "isinf")):
            inner, reduction = n.args[0], n.func.attr
        else:
            return None
        if len(inner.args) != 1 or inner.keywords or not isinstance(inner.args[0], ast.Name):
            return None
        return reduction, inner.func.attr, inner.args[0].id

    test = node.test
    others = test.values[:-1] if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else []
    condition = test.values[-1] if others else test
    negated = isinstance(condition, ast.UnaryOp) and isinstance(condition.op, ast.Not)
    found = tested(condition.operand if negated else condition)
    if found is None or found[:2] != key or negated == _CLAMP_CONDITIONS[key] or \
            any(torch_call(n, ("isfinite", "isinf")) for o in others for n in ast.walk(o)):
        return None
    name = found[2]
    *first, last = node.body
    if not (isinstance(last, ast.Assign) and len(last.targets) == 1 and isinstance(last.targets[0], ast.Name)
            and last.targets[0].id == name and torch_call(last.value, ("clamp", "clip"))
            and last.value.args and isinstance(last.value.args[0], ast.Name) and last.value.args[0].id == name
            and len(last.value.args) <= 3 and all(k.arg in ("min", "max") for k in last.value.keywords)):
        return None
    assigned = set()
    for s in first:
        if not (isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)
                and s.targets[0].id != name and all(torch_call(n, ("finfo",)) for n in ast.walk(s.value)
                                                    if isinstance(n, ast.Call))):
            return None
        assigned.add(s.targets[0].id)
    # reads of those names that a statement before them in the same block assigns, with this branch not in between
    # (this body's own, the same idiom's elsewhere in the function): they do not see whether this branch ran
    preceded = set()
    for block in (n.body for n in ast.walk(function) if isinstance(n, ast.If)):
        for k, s in enumerate(block):
            if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
                for later in block[k + 1:]:
                    if any(n is node for n in ast.walk(later)):
                        break
                    preceded |= {id(n) for n in ast.walk(later)
                                 if isinstance(n, ast.Name) and n.id == s.targets[0].id}
    if any(isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in assigned and id(n) not in preceded
           for n in ast.walk(function)):
        return None             # a name the branch sets is read elsewhere: the trace would set it where eager does not
    return name


@functools.lru_cache(maxsize=8)
def _parsed_source(filename: str, source: str):
    import ast
    try:
        return ast.parse(source, filename)
    except (SyntaxError, ValueError):
        return None


def _parsed(filename: str, module_globals):
    """The module source of ``filename`` parsed (as linecache reads it), or None."""
    import linecache
    lines = linecache.getlines(filename, module_globals)
    return _parsed_source(filename, "".join(lines)) if lines else None


@contextlib.contextmanager
def _fake_tensor_errors_unlogged():
    """torch logs an op that fails on fake tensors (wrong shapes in the example inputs) at ERROR level, with its
    traceback, before it raises; the capture's error says it once, by the forward's line, so the log is held back."""
    import logging
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _forwards_block(frame) -> bool:
    """Whether the grad-mode block entered from ``frame`` is the forward's own (the user's, a library's model code,
    or torch.nn's: spectral_norm's power iteration, an embedding's max_norm, gaussian_nll_loss's clamp of the
    variance), not torch's machinery or autofuse's: its caller past ``contextlib``, or for a decorated function that
    function."""
    import torch.utils._contextlib as decorators
    while frame is not None and frame.f_code.co_filename == contextlib.__file__:
        frame = frame.f_back
    if frame is None:
        return False
    if frame.f_code.co_filename == decorators.__file__:
        module = getattr(frame.f_locals.get("func"), "__module__", None) or "torch"
        return module.split(".")[0] not in ("torch", "autofuse") or module.startswith("torch.nn.")
    name = os.path.abspath(frame.f_code.co_filename)
    return not name.startswith((_TORCH_DIR, _OWN_DIR)) or name.startswith(_TORCH_NN_DIR)


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_TORCH_NN_DIR = os.path.join(_TORCH_DIR, "nn") + os.sep
_OVERRIDES = torch.overrides.__file__
_TENSOR = torch._tensor.__file__
_FUNCTIONAL_TENSOR = torch._subclasses.functional_tensor.__file__
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__)) + os.sep


_CAPTURING = threading.local()


def set_grad_enabled_outside_capture(mode: bool) -> None:
    """``torch._C._set_grad_enabled`` in a Dynamo graph once :func:`mark_grad_blocks` has marked the blocks: it sets
    the mode when the graph runs as Dynamo gave it, and nothing while this thread captures it. The capture traces
    without grad and reads each block's mode from the marks; the mode a block's end restores (grad on) would make
    the trace record autograd from there on, and a custom op's autograd there (transformers' grouped_mm_fallback after
    PhiMoE's no_grad router) turns torch.export's trace into a joint forward-backward one, which fails."""
    if not getattr(_CAPTURING, "active", False):
        torch._C._set_grad_enabled(mode)


@contextlib.contextmanager
def _grad_mode_calls_inert():
    before = getattr(_CAPTURING, "active", False)
    _CAPTURING.active = True
    try:
        yield
    finally:
        _CAPTURING.active = before


def mark_grad_blocks(gm: fx.GraphModule) -> None:
    """A Dynamo graph spells the forward's grad-mode blocks as ``torch._C._set_grad_enabled(mode)`` calls (an
    ``inference_mode()`` block as ``_enter_inference_mode(True)`` ... ``_exit_inference_mode``), which a capture
    of it (one trace without grad) does not keep: the nodes after each carry its mode as :func:`_grad_blocks` marks
    a block's, and the graph reads a value made without grad detached outside its
    block (:func:`_detach_grad_free_blocks`), so that its capture has eager's gradients."""
    from torch.autograd import grad_mode
    mode, marked, outer = None, False, []         # outer: the modes an inference_mode block put aside
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in (torch._C._set_grad_enabled, set_grad_enabled_outside_capture) \
                and n.args:
            mode, marked = bool(n.args[0]), True
        elif n.op == "call_function" and n.target is grad_mode._enter_inference_mode and n.args:
            outer.append(mode)
            if n.args[0]:                        # inference_mode(): nothing it makes carries a gradient
                mode, marked = False, True
        elif n.op == "call_function" and n.target is grad_mode._exit_inference_mode and outer:
            mode = outer.pop()
        elif mode is not None and n.op not in ("placeholder", "output"):
            n.meta["custom"] = {**(n.meta.get("custom") or {}), GRAD_BLOCK: mode}
    inert = [n for n in gm.graph.nodes if is_grad_mode_call(n)]
    for n in inert:                 # the marks carry the modes into the capture, which traces without grad
        n.target = set_grad_enabled_outside_capture
    grad_free = _mark_grad_free_checkpoints(gm)
    gm.meta["autofuse_grad_free_checkpoints"] = grad_free       # the plan warns of them (capture reads it)
    _mark_checkpoints(gm)            # kept in a plan with grad
    if (marked or grad_free) and (_pass_updates_in_place(gm) | _detach_grad_free_blocks(gm)) or inert:
        gm.recompile()


def _mark_checkpoints(gm: fx.GraphModule) -> None:
    """Each ``tag_activation_checkpoint`` of a Dynamo graph (``torch.utils.checkpoint.checkpoint``) that carries a
    gradient numbered as :func:`_checkpoints` numbers a checkpoint in a capture of the forward (:data:`CHECKPOINT`,
    on the operator, the getitems of its outputs and its body's nodes: the capture traces each body node with that
    node's own metadata), so that a plan with grad keeps it (:mod:`autofuse.checkpointing`)."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    count = 0
    for n in gm.graph.nodes:
        if hop is None or n.op != "call_function" or n.target is not hop or \
                (n.meta.get("custom") or {}).get(GRAD_BLOCK) is False:
            continue
        body = n.args[0]
        nodes = [n, *[u for u in n.users if u.op == "call_function" and u.target is operator.getitem]]
        if isinstance(body, fx.Node) and body.op == "get_attr":
            sub = get_attr_value(gm, body.target)
            if isinstance(sub, fx.GraphModule):
                nodes += [m for m in sub.graph.nodes if m.op not in ("placeholder", "output")]
        for m in nodes:
            m.meta["custom"] = {**(m.meta.get("custom") or {}), CHECKPOINT: ("dynamo", count)}
        count += 1


def _mark_grad_free_checkpoints(gm: fx.GraphModule) -> int:
    """Dynamo spells ``torch.utils.checkpoint.checkpoint`` as ``tag_activation_checkpoint``, which torch runs as
    the non-reentrant form whatever ``use_reentrant`` says. A reentrant one called with grad where none of its
    tensor inputs requires grad gives outputs without a gradient in eager (torch's ``CheckpointFunction``): its
    outputs are marked as made in a grad-free block (:data:`GRAD_BLOCK`), so that they are read detached
    (:func:`_detach_grad_free_blocks`), as :func:`_checkpoints` does in a capture of the forward. Dynamo passes
    the function's parameters and the tensors it closes over as inputs of the operator too, in no telling order:
    the model's parameters among them are taken as the function's own, every other tensor as an input of the
    checkpoint. How many were marked."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)

    def requires(a) -> bool:
        if not isinstance(a, fx.Node) or a.op == "get_attr":
            return False
        v = a.meta.get("example_value", a.meta.get("val"))
        return isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and v.requires_grad

    count = 0
    for n in gm.graph.nodes:
        if hop is None or n.op != "call_function" or n.target is not hop or \
                n.kwargs.get("use_reentrant", True) is False:       # not given: torch's default, reentrant
            continue
        mode = (n.meta.get("custom") or {}).get(GRAD_BLOCK)
        if not (torch.is_grad_enabled() if mode is None else mode) or any(map(requires, n.args[1:])):
            continue
        for m in (n, *[u for u in n.users if u.op == "call_function" and u.target is operator.getitem]):
            m.meta["custom"] = {**(m.meta.get("custom") or {}), GRAD_BLOCK: False}
        count += 1
    return count


def _grad_free(n: fx.Node) -> bool:
    """Whether ``n`` was made inside one of the forward's own grad-free blocks (its :data:`GRAD_BLOCK` mark)."""
    return (n.meta.get("custom") or {}).get(GRAD_BLOCK) is False


def _in_place_name(name: str) -> bool:
    """Whether a method or function name updates its first argument in place: ``clamp_``, ``__setitem__``,
    ``__iadd__`` (not a dunder such as ``__add__``)."""
    return name == "__setitem__" or (name.startswith("__i") and name.endswith("__")) or \
        (name.endswith("_") and not name.endswith("__"))


_AUGMENTED = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.ipow,
              operator.imod, operator.iand, operator.ior, operator.ixor}


def _in_place_of(n: fx.Node):
    """The tensor a Dynamo graph's node updates in place (its first argument: ``h.clamp_()``, ``h[i] = v``,
    ``h += 1``, ``torch.relu_(h)``), or None."""
    if not n.args or not isinstance(n.args[0], fx.Node) or n.op not in ("call_method", "call_function"):
        return None
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
    if n.target is operator.setitem or n.target in _AUGMENTED or (isinstance(name, str) and _in_place_name(name)):
        return n.args[0]
    return None


def _pass_updates_in_place(gm: fx.GraphModule) -> bool:
    """In a Dynamo graph, a tensor made with grad and updated in place only inside the forward's own grad-free
    blocks is one node before and after (the update mutates it), and the capture would differentiate through the
    update. Where every read of it with grad comes after its last update, those reads get
    :data:`~autofuse.grad_ops.PASS_GRADIENT` of it and of a copy taken where it is made: the new values,
    the gradient to the tensor's history unchanged, as eager's autograd (which does not see the update) gives
    it. Whether the graph changed."""
    def value(n):
        return n.meta.get("example_value", n.meta.get("val"))

    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    updates: dict = {}                              # tensor -> the nodes that update it, in order
    alias: dict = {}                                # an update -> the tensor (it returns it)
    for n in gm.graph.nodes:
        h = _in_place_of(n)
        if h is not None:
            h = alias.get(h, h)
            alias[n] = h
            updates.setdefault(h, []).append(n)
    tracked = _tracked(gm, value)
    changed = False
    for h, ups in updates.items():
        if h not in tracked or _grad_free(h) or not all(_grad_free(u) for u in ups) or \
                not isinstance(value(h), torch.Tensor):
            continue
        first, last = order[ups[0]], order[ups[-1]]
        readers = {r for a in (h, *ups) for r in a.users if r not in ups and order[r] > first and
                   (r.op == "output" or not _grad_free(r))}
        if not readers or any(order[r] < last for r in readers):
            continue                                # read with grad between two updates: left as it is
        # both with grad: the copy where the tensor is made, the pass before its first read after the block (the
        # graph also runs as it is, unfused, where its capture fails)
        made = h if h.op != "placeholder" else next(n for n in gm.graph.nodes if n.op != "placeholder").prev
        with gm.graph.inserting_after(made):
            old = gm.graph.call_method("clone", (h,))
        with gm.graph.inserting_before(min(readers, key=order.get)):
            new = gm.graph.call_function(PASS_GRADIENT, (h, old))
        for added in (old, new):
            added.meta["example_value"] = value(h)
        for r in readers:
            for a in (h, *ups):
                r.replace_input_with(a, new)
        changed = True
    return changed


def _tracked(gm: fx.GraphModule, value) -> set:
    """The nodes whose value autograd tracks when the graph runs with grad: floating placeholders, parameters and
    tensors that require grad, and what is computed from them."""
    tracked: set = set()
    for n in gm.graph.nodes:
        v = value(n)
        if n.op == "placeholder":
            if floating(v):
                tracked.add(n)
        elif n.op == "get_attr":
            t = _state_of(gm, n)
            if isinstance(t, torch.Tensor) and (isinstance(t, torch.nn.Parameter) or t.requires_grad):
                tracked.add(n)
        elif n.op in ("call_function", "call_method", "call_module") and any(
                a in tracked for a in n.all_input_nodes) and (floating(v) or isinstance(v, (tuple, list))):
            tracked.add(n)
    return tracked


def _detach_grad_free_blocks(gm: fx.GraphModule) -> bool:
    """A value the forward computed inside its own ``torch.no_grad()`` block does not carry a gradient in eager,
    but the captured graph (one trace without grad) computes it like any other, so autograd would differentiate
    through it. Where such a value, made from what may require grad (a parameter, a floating input), is read
    outside the block (or returned), the reader gets ``aten.detach`` of it: eager's gradients. Canonicalize keeps
    that detach in a graph captured with grad, and drops it (the plan then serves only calls without grad) in one
    captured without. A value that is a tensor made before the block and updated in place inside it
    (``h.clamp_(-1, 1)``) is read as :data:`~autofuse.grad_ops.PASS_GRADIENT` of it and that tensor instead: the
    new values, the gradient to ``h`` unchanged, as eager's autograd, which does not see the update, gives it.
    Also serves a Dynamo graph (values in ``example_value``). Whether a detach or a pass was added."""
    aten = torch.ops.aten

    def value(n):
        return n.meta.get("val", n.meta.get("example_value"))

    tracked = _tracked(gm, value)

    def updated(n):
        # the tensor made before the block that ``n`` is a new version of (``h.clamp_()``, ``h[:, :3] = 0`` on a
        # tensor made with grad): eager records no update, so ``h``'s gradient passes it unchanged
        while _grad_free(n):
            n = _updated_in_place(n)
            if n is None:
                return None
        return n

    added = False
    for n in list(gm.graph.nodes):
        if not (_grad_free(n) and n in tracked and floating(value(n))):
            continue
        outside = [u for u in n.users if u.op == "output" or not _grad_free(u)]
        if not outside:
            continue
        source = updated(n)
        same = source in tracked and isinstance(value(source), torch.Tensor) and \
            (value(source).shape, value(source).dtype) == (value(n).shape, value(n).dtype)
        with gm.graph.inserting_after(n):
            d = gm.graph.call_function(PASS_GRADIENT, (n, source)) if same else \
                gm.graph.call_function(aten.detach.default, (n,))
        d.meta = {k: (v.detach() if k in ("val", "example_value") else v) for k, v in n.meta.items() if k != "custom"}
        for u in outside:
            u.replace_input_with(n, d)
        added = True
    return added


def _pass_trained_updates(gm: fx.GraphModule, model: torch.nn.Module) -> tuple:
    """A parameter that requires grad the forward updates in place (Gemma 3n clamps its AltUp coefficients through
    ``.data`` in training, ``nn.Embedding(max_norm=...)`` renormalises the rows it looks up under
    ``torch.no_grad()``): eager's autograd does not see the update, so what reads the parameter after it gets the
    new values and passes its gradient to the parameter. The captured graph computes the new value from a detached
    copy (``.data``) or inside the grad-free block, so its readers are given
    :data:`~autofuse.grad_ops.PASS_GRADIENT` of it and the parameter: the new values, the gradient to the
    parameter, as in eager. A read of the parameter before its update (or between two updates) is refused: eager's
    backward reads the parameter as it is when the backward runs, the updated values, where the graph's would read
    the values it read. A capture without grad needs neither (its plan serves calls without grad only:
    :class:`autofuse.engine.Plan`). Returns the flat inputs so updated (indices) whose reads pass their gradient."""
    if not gm.meta.get("autofuse_trained_updates") or not torch.is_grad_enabled():
        return ()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    changed = False
    for pos, target in gm.meta["autofuse_trained_updates"]:
        value = out.args[0][pos]
        chain = ancestors([value]) | {value}
        if isinstance(target, int):                         # the flat input at that place
            sources = [placeholders[target]] if placeholders[target] in chain else []
            target = placeholders[target].name
        else:
            param = model.get_parameter(target)
            sources = [n for n in chain if n.op == "get_attr" and _state_of(gm, n) is param]
        versions = set(sources)
        for n in gm.graph.nodes:                            # the values that are the parameter's storage in eager
            if n in chain and n not in versions and n.op == "call_function" and (
                    (n.target is torch.ops.aten.detach.default and n.args[0] in versions)
                    or _updated_in_place(n) in versions):
                versions.add(n)
        early = [u for v in versions - {value} for u in v.users
                 if u not in chain and u.op != "output" and not _gradient_route(u, v)]
        if not sources or early:
            where = f" ({describe_node(early[0])})" if early else ""
            raise CaptureError("export", f"capture failed on route 'export': the forward reads {target!r}{where}, "
                                         f"which requires grad, before it updates it in place (through .data or "
                                         f"under torch.no_grad()); eager's backward reads the tensor's updated "
                                         f"values where it saved it, the captured graph's would read the values it "
                                         f"read. hint: update it before the forward reads it, capture in eval mode, "
                                         f"or freeze it (requires_grad_(False)).")
        if value.target is PASS_GRADIENT:
            continue                                        # updated in a grad-free block: read through a pass already
        readers = [u for u in value.users
                   if u.op != "output" and not (u.target is PASS_GRADIENT and u.args[0] is value)]
        if not readers:
            continue
        with gm.graph.inserting_after(value):
            passed = gm.graph.call_function(PASS_GRADIENT, (value, sources[0]))
        passed.meta = {k: (v.detach() if k in ("val", "example_value") else v) for k, v in value.meta.items()
                       if k != "custom"}
        for u in readers:
            u.replace_input_with(value, passed)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return tuple(t for _, t in gm.meta["autofuse_trained_updates"] if isinstance(t, int))


def _gradient_route(u: fx.Node, v: fx.Node) -> bool:
    """Whether ``u`` reads ``v`` only to route a gradient: a :data:`~autofuse.grad_ops.PASS_GRADIENT` whose source it
    is, or a copy of it that only such passes read (:func:`_pass_updates_in_place` takes one where a Dynamo graph's
    input is updated in place)."""
    if u.target is PASS_GRADIENT:
        return len(u.args) > 1 and u.args[1] is v and u.args[0] is not v
    return u.target is torch.ops.aten.clone.default and bool(u.users) and \
        all(w.target is PASS_GRADIENT and w.args[1] is u for w in u.users)


def _state_of(gm: fx.GraphModule, n: fx.Node):
    """The tensor a get_attr node ``n`` reads (None for another node)."""
    if n.op != "get_attr":
        return None
    try:
        return state_tensor(gm, n.target)
    except AttributeError:
        return None


def _updated_in_place(n: fx.Node):
    """The node ``n`` is the new version of when the functional graph made ``n`` from an in-place update of a
    tensor (its ``torch_fn`` names an in-place method, ``__setitem__`` or an augmented assignment): that
    update's first argument, or None. ``h.copy_(y)`` keeps its destination first only as ``aten.copy``; as a
    clone or cast of ``y`` (the same shape) the destination is not in the graph: None."""
    fn = (n.meta.get("torch_fn") or ("", ""))[1].rsplit(".", 1)[-1]
    if not _in_place_name(fn) or n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    if fn == "copy_" and n.target != torch.ops.aten.copy.default:
        return None
    return n.args[0]


def _shapes(tree):
    """A Function call's arguments with every tensor as ``(shape, dtype)`` (None where a size is symbolic)."""
    def one(x):
        if not isinstance(x, torch.Tensor):
            return x
        ok = all(isinstance(d, int) for d in x.shape)
        return _TensorArg(tuple(x.shape) if ok else None, x.dtype)
    return pytree.tree_map(one, tree)


@dataclass(frozen=True)
class _TensorArg:
    shape: tuple | None
    dtype: torch.dtype


class _Ctx:
    """A stand-in for a Function's ctx when its forward is called directly (differentiated by autograd)."""

    needs_input_grad = ()

    def save_for_backward(self, *ts):
        self.saved_tensors = ts

    def mark_dirty(self, *_):
        pass

    def mark_non_differentiable(self, *_):
        pass

    def set_materialize_grads(self, _):
        pass


#: The dtype a custom Function's backward is checked in, for arguments of a 16-bit float dtype.
_CHECK_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def check_argument(a, g: torch.Generator):
    """The value a derivative check passes for an argument: for a tensor's :class:`_TensorArg`, random normal values
    (fp32 for a 16-bit float dtype, :data:`_CHECK_DTYPE`) that require grad, or zeros of an integer dtype; anything
    else as it is."""
    if not isinstance(a, _TensorArg):
        return a
    if a.dtype.is_floating_point:
        return torch.randn(a.shape, generator=g).to(_CHECK_DTYPE.get(a.dtype, a.dtype)).requires_grad_()
    return torch.zeros(a.shape, dtype=a.dtype)


def _backward_is_forwards_derivative(cls, args, kwargs) -> bool:
    """Whether ``cls``'s backward gives the gradient autograd finds through its forward, on random inputs of the
    captured call's shapes (what a captured graph, which keeps only the forward, would give): within fp32
    rounding. 16-bit arguments are checked in fp32: the question is whether the backward is the forward's
    derivative, and two spellings of one derivative differ by more than fp32's tolerance when each rounds to 16 bits
    (BLOOM's GeLU in bf16). False where that cannot be checked (symbolic or large sizes, symbolic_trace's proxies
    for arguments, a forward that needs its ctx)."""
    every = pytree.tree_leaves((args, kwargs))
    if any(isinstance(a, fx.Proxy) for a in every):
        return False            # symbolic_trace's values: no shapes to draw from, and applying it would trace
    leaves = [a for a in every if isinstance(a, _TensorArg)]
    if any(a.shape is None for a in leaves) or sum(math.prod(a.shape) for a in leaves) > 1 << 20:
        return False
    g = torch.Generator().manual_seed(0)
    try:
        with torch.random.fork_rng(), torch.enable_grad():
            grads = []
            for direct in (False, True):
                g.manual_seed(0)
                a, k = pytree.tree_map(lambda a: check_argument(a, g), (args, kwargs))
                if direct:
                    try:
                        out = cls.forward(_Ctx(), *a, **k)
                    except TypeError:            # a forward without ctx (setup_context style)
                        out = cls.forward(*a, **k)
                else:
                    out = cls.apply(*a, **k)
                outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
                ins = [t for t in pytree.tree_leaves((a, k)) if isinstance(t, torch.Tensor) and t.requires_grad]
                g2 = torch.Generator().manual_seed(1)
                gouts = [torch.randn(o.shape, generator=g2).to(o.dtype) for o in outs]
                grads.append(torch.autograd.grad(outs, ins, gouts, allow_unused=True) if outs else
                             (None,) * len(ins))
    except Exception:  # noqa: BLE001 - a Function that cannot be run so is not known to be harmless
        return False
    return gradients_agree(*grads)


def gradients_agree(got, want) -> bool:
    """Whether two lists of gradients (None for an input given none) agree within fp32 rounding: the rule that
    says a custom backward is its forward's derivative. NaN where both give NaN is agreement (a sqrt's derivative
    at random negatives); a NaN or inf on one side only is not. The tolerance scales with the largest finite
    gradient (a NaN would make it NaN)."""
    if len(got) != len(want):
        return False
    for x, y in zip(got, want):
        if (x is None) != (y is None):
            return False
        if x is None:
            continue
        if x.shape != y.shape:
            return False
        finite = y.float().abs()[torch.isfinite(y)]
        atol = 1e-5 * (1.0 + (float(finite.max()) if finite.numel() else 0.0))
        if not torch.allclose(x.float(), y.float(), rtol=1e-3, atol=atol, equal_nan=True):
            return False
    return True


def _custom_backwards(model, functions, inputs) -> list:
    """The custom autograd.Functions a forward traced through (``functions``, :func:`_custom_functions`) whose
    backward a graph captured with grad would lose: while anything the call reads requires grad, those whose
    backward does not give what autograd finds through their forward (BLOOM's GeLU does) on random inputs of the
    call's shapes. A gradient reversal or a straight-through estimator does not: capture keeps such a Function
    whole (:func:`_keep_application`)."""
    if not functions or not torch.is_grad_enabled():
        return []
    if not any(p.requires_grad for p in model.parameters()) and not any(
            getattr(x, "requires_grad", False) for x in pytree.tree_leaves(inputs)):
        return []
    return [cls for cls, a, k in functions if not _backward_is_forwards_derivative(cls, a, k)]


def _refuse_custom_backwards(differing):
    """Refuse a graph captured with grad through custom autograd.Functions whose backward it would lose, where
    they cannot be kept whole (:class:`NotKeepable`; on the symbolic_trace route, which hands them proxies)."""
    names = ", ".join(f.__qualname__ for f in differing)
    raise CaptureError("export", f"capture failed: the forward applies the custom autograd.Function(s) {names}, "
                                 f"whose backward a captured graph does not keep (autograd would differentiate their "
                                 f"forward instead), and which cannot be kept whole as one op here (an in-place "
                                 f"forward that marks its input dirty, a non-tensor output, an argument that is a "
                                 f"symbolic size or an object other than a tensor or a plain value, or the "
                                 f"symbolic_trace route). hint: for inference, fuse and call "
                                 f"the model under torch.no_grad(); to train, compile it with torch.compile(model, "
                                 f"backend='autofuse'), which keeps each such Function whole with its own backward "
                                 f"and fuses around it (or run the model eagerly).")


def _constant_argument(x) -> bool:
    """Whether a Function's non-tensor argument can stay in the graph as the value the call passed: a number,
    string, flag or None, a dtype, device, layout or enum, a class or function, or a module (the user's own object:
    it is applied as it is when the graph runs). Not a symbolic size, nor an object that may hold the trace's
    tensors."""
    import enum
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return False
    return isinstance(x, (bool, int, float, complex, str, type(None), torch.dtype, torch.device, torch.layout,
                          torch.memory_format, enum.Enum, type, types.FunctionType, types.BuiltinFunctionType,
                          torch.nn.Module))


#: how deep this thread is inside a kept Function's application (:func:`_keep_application`)
_KEEPING = threading.local()


class NotKeepable(Exception):
    """A custom autograd.Function's application cannot be kept as one op; the capture traces through it."""


def _keep_application(cls, args, kwargs, frame):
    """Apply ``cls`` inside a capture as one ``autofuse_grad::user_function`` op (:mod:`autofuse.grad_ops`), which
    applies the Function itself when the graph runs: with grad, autograd records the Function's own node (its ctx,
    its backward), as eager does. Its tensor arguments are the op's; everything else is kept as the call passed it
    (a constant of the graph, as any Python value the forward passes). Raises :class:`NotKeepable` where that would
    not be the user's call: an argument other than a tensor or a :func:`_constant_argument` (a symbolic size, a
    proxy, an object that may hold the trace's tensors), a non-tensor output, an output that is an argument (an
    in-place forward that marks it dirty)."""
    from autofuse.grad_ops import USER_FUNCTION_OP, USER_FUNCTIONS, register_user_function
    flat, spec = pytree.tree_flatten((args, kwargs))
    if not all(isinstance(x, torch.Tensor) or _constant_argument(x) for x in flat):
        raise NotKeepable(cls)
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    import linecache
    where = (f'{cls.__qualname__}: File "{frame.f_code.co_filename}", line {frame.f_lineno}, in '
             f'{frame.f_code.co_name}: {linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()}')
    key = register_user_function(cls, spec, [None if isinstance(x, torch.Tensor) else x for x in flat], where)
    _KEEPING.depth = getattr(_KEEPING, "depth", 0) + 1
    try:
        outs = USER_FUNCTION_OP(tensors, key)
    except Exception as e:  # noqa: BLE001 - one that cannot be kept (its fake run says why) is traced through
        raise NotKeepable(cls) from e
    finally:
        _KEEPING.depth -= 1
    return pytree.tree_unflatten(list(outs), USER_FUNCTIONS[key].out_spec)


# ---------------------------------------------------------------------------------------------- routes

def _export_retrace(model, args, kwargs, dynamic_shapes=None):
    """``torch.export.export`` then ``run_decompositions``: two traces (the reference for
    :func:`_export_functional`), every composite op preserved but those that update an input unannounced
    (:data:`autofuse.composite.MUTATING_UNTAGGED`)."""
    from torch._export.utils import _get_decomp_for_cia
    from autofuse.composite import MUTATING_UNTAGGED
    with _random_ops_kept(), caches.plain_lengths():
        return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False
                                   ).run_decompositions({op: _get_decomp_for_cia(op) for op in MUTATING_UNTAGGED})


def _random_ops_kept():
    """The context in which a trace keeps a random op whose result is unused (a dead training-mode dropout): eager
    runs it, and its draw moves torch's generator, so every later draw depends on it. Under a tracing context, fx's
    dead-code elimination treats random ops as pure unless inductor's ``fallback_random`` is set."""
    import torch._inductor.config as inductor_config
    return inductor_config.patch(fallback_random=True)


def _export_functional(model, args, kwargs, dynamic_shapes=None):
    """One non-strict trace straight to functional aten, composite ops preserved as ``run_decompositions({})``
    preserves them: torch's own aot-dispatch export (``pre_dispatch=False``) inside the context that
    ``run_decompositions`` puts around its re-trace. Falls back to two traces if torch lacks these internals."""
    from autofuse.composite import keep_composites, preserved_ops, torch_has_composite_context
    try:
        from torch.export._trace import _export
    except ImportError:
        _export = None
    if _export is None or not torch_has_composite_context():      # another torch: the public two-trace path
        return _export_retrace(model, args, kwargs, dynamic_shapes)
    kept = _python_values_kept(model, args, kwargs, symbolic=dynamic_shapes is not None)
    with keep_composites(preserved_ops()), _random_ops_kept(), caches.plain_lengths():
        return _export(kept, args, kwargs, dynamic_shapes, strict=False, pre_dispatch=False)


def _python_values_kept(model, args, kwargs, symbolic=False):
    """``model``, or where the call passes Python ints or bools, a stand-in whose forward gets them as given. The
    aot-dispatch trace (``pre_dispatch=False``) hands the forward a SymInt for every int argument (torch.export's
    public path keeps them plain): ``isinstance(k, int)`` is then false (transformers' ``logits_to_keep`` slices
    as an index), ``is_causal=flag`` is refused, a size computed from it stays symbolic. A plan is made per value
    of such arguments (they are part of its key), so the forward may see them as the constants they are. The
    stand-in (:func:`with_forward`) calls the model's own forward with those leaves put back."""
    import inspect
    flat, spec = pytree.tree_flatten((args, kwargs))
    # a KV cache's lifted length (caches.Length) stays as the trace gives it in a symbolic export: a size of it
    kept = [isinstance(x, int) and not (symbolic and type(x) is caches.Length) for x in flat]
    if not any(kept):
        return model
    own = _own_forward(model)

    def forward(*a, **k):
        got, got_spec = pytree.tree_flatten((a, k))
        if got_spec != spec:
            return own(*a, **k)
        a, k = pytree.tree_unflatten([x if keep else g for g, x, keep in zip(got, flat, kept)], spec)
        return own(*a, **k)

    try:
        forward.__signature__ = inspect.signature(own)
    except (TypeError, ValueError):
        pass
    return with_forward(model, forward)


def with_forward(model, forward):
    """A stand-in for ``model`` whose calls run ``forward``: a shallow copy (the same submodules, parameters and
    their names, so a capture of it names everything as the model's) with ``forward`` set on the instance.
    For a GraphModule (Dynamo's graph, a symbolic trace) the copy is a plain ``nn.Module`` holding the graph
    module's attributes: torch.export runs a GraphModule through an fx ``Interpreter`` over its graph
    (``torch.export._trace._non_strict_export``), never calling its ``forward``, so an instance ``forward`` on a
    GraphModule would be bypassed. ``forward`` should then call :func:`_own_forward`'s runner of the graph."""
    import copy
    if isinstance(model, fx.GraphModule):
        stand_in = torch.nn.Module.__new__(torch.nn.Module)
        stand_in.__dict__.update(model.__dict__)
    else:
        stand_in = copy.copy(model)
    object.__setattr__(stand_in, "forward", forward)
    return stand_in


def _own_forward(model):
    """What runs ``model``'s forward inside a stand-in's (:func:`with_forward`): its bound ``forward``, or for a
    GraphModule what torch.export runs for one, an fx ``Interpreter`` over its graph with each node's meta kept
    (the new nodes keep the user's stack trace)."""
    import inspect

    import torch.fx.traceback as fx_traceback
    if not isinstance(model, fx.GraphModule):
        return model.forward

    def run(*args, **kwargs):
        with fx_traceback.preserve_node_meta():
            return fx.Interpreter(model).run(*args, *kwargs.values())
    try:
        run.__signature__ = inspect.signature(model.forward)
    except (TypeError, ValueError):
        pass
    return run


def _capture_export(model, args, kwargs, export=None):
    ep = (export or _export_functional)(model, args, kwargs)
    sig = ep.graph_signature
    attr_of = {}  # placeholder name -> (dotted attribute name, tensor)
    for spec in sig.input_specs:
        kind, name, target = spec.kind.name, spec.arg.name, spec.target
        if kind == "USER_INPUT":
            continue
        tensor = lifted_input(model, ep, spec)
        if tensor is None:
            raise CaptureError("export", f"capture failed on route 'export': unsupported graph input "
                                         f"{name!r} of kind {kind}")
        attr_of[name] = ("_autofuse_constants." + target.replace(".", "_") if kind == "CONSTANT_TENSOR" else target,
                         tensor)
    state = {n for n, _ in model.named_parameters(remove_duplicate=False)} | \
        {n for n, _ in model.named_buffers(remove_duplicate=False)}
    updates = [(i, s.target) for i, s in enumerate(sig.output_specs)
               if s.kind.name in ("BUFFER_MUTATION", "PARAMETER_MUTATION") and s.target in state]
    # a parameter that requires grad updated in place (through .data, or in a torch.no_grad() block): its later
    # reads carry its gradient in eager, which _pass_trained_updates gives the captured graph's new value
    trained = {t for i, t in updates if sig.output_specs[i].kind.name == "PARAMETER_MUTATION"
               and model.get_parameter(t).requires_grad}
    # an input tensor updated in place (a static KV cache): output index -> its place among the flat inputs
    leaf_of = {s.arg.name: k for k, s in enumerate(s for s in sig.input_specs if s.kind.name == "USER_INPUT")}
    leaves = pytree.tree_leaves((args, kwargs))
    inputs = {i: leaf_of[s.target] for i, s in enumerate(sig.output_specs)
              if s.kind.name == "USER_INPUT_MUTATION" and s.target in leaf_of} if len(leaves) == len(leaf_of) else {}
    # an input that requires grad: a leaf (a parameter Dynamo passes as an input) is updated outside autograd, as
    # eager allows no other update of it, and reads after it pass their gradient to it (_pass_trained_updates); the
    # update of one made from others (with grad) is autograd's, which the write-back cannot give
    graded = [sig.output_specs[i].target for i, leaf in inputs.items()
              if getattr(leaves[leaf], "requires_grad", False) and not leaves[leaf].is_leaf]
    if graded:
        raise CaptureError("export", f"capture failed on route 'export': the forward updates the input(s) {graded} "
                                     f"in place, and they require grad; eager's later reads of them carry their "
                                     f"gradient, which the captured graph's new values do not. hint: pass inputs "
                                     f"that do not require grad, or return the new value instead of updating it.")
    written = {i for i, _ in updates} | set(inputs)
    other = [s.target or s.kind.name for i, s in enumerate(sig.output_specs)
             if s.kind.name != "USER_OUTPUT" and i not in written]
    if other:
        raise CaptureError("export", f"capture failed on route 'export': the forward mutates {other}, which is not "
                                     f"a parameter or buffer of the model or an input tensor; autofuse writes back "
                                     f"only those. hint: make the state a registered buffer, or remove the in-place "
                                     f"update.")
    user_out = [i for i, s in enumerate(sig.output_specs) if s.kind.name == "USER_OUTPUT"]
    # one tensor under several names (tied weights): every use reads it through its last name, as the
    # re-trace of run_decompositions does (its fake tensor is tracked by the last placeholder made for it)
    last = {}
    for name, (_, tensor) in attr_of.items():
        last[id(tensor)] = name
    alias = {name: last[id(tensor)] for name, (_, tensor) in attr_of.items()}
    # the updated state's values follow the user's outputs, the model's then the inputs' (Captured.update_state
    # writes them back)
    gm = _lift_to_attrs(ep.graph_module, attr_of, user_out + [i for i, _ in updates] + list(inputs), alias)
    gm.meta["autofuse_state_updates"] = tuple(target for _, target in updates)
    gm.meta["autofuse_trained_updates"] = tuple(
        [(len(user_out) + k, target) for k, (_, target) in enumerate(updates) if target in trained]
        + [(len(user_out) + len(updates) + k, leaf) for k, leaf in enumerate(inputs.values())
           if getattr(leaves[leaf], "requires_grad", False)])
    gm.meta["autofuse_input_updates"] = tuple(inputs.values())
    # a program served from a size family's symbolic export (autofuse.sizes) names the custom autograd.Functions its
    # traces applied: the forward did not run for this capture
    gm.meta["autofuse_served_functions"] = getattr(ep, "functions", ())
    return gm, ep.call_spec.in_spec, ep.call_spec.out_spec


def lifted_input(model: torch.nn.Module, program, spec):
    """The tensor an exported program's lifted input ``spec`` reads: the model's own parameter or buffer (as it is
    now), or the program's constant; None for another kind (a user input, a custom object)."""
    kind = spec.kind.name
    if kind == "PARAMETER":
        return model.get_parameter(spec.target)
    if kind == "BUFFER":
        return model.get_buffer(spec.target)
    if kind == "CONSTANT_TENSOR":
        return program.constants[spec.target]
    return None


def state_tensor(model: torch.nn.Module, fqn: str) -> torch.Tensor:
    """The model's parameter or buffer named ``fqn`` (dotted), as it is now."""
    mod, _, name = fqn.rpartition(".")
    return getattr(model.get_submodule(mod) if mod else model, name)


def _capture_symbolic_trace(model, args, kwargs):
    # fx.symbolic_trace gives the torch-level graph (its leaf-module and fx.wrap rules apply); the
    # lowering to functional aten + FakeTensor meta reuses export's non-strict tracer, so both routes
    # share one graph form by construction. The traced module holds the model's own tensors.
    # The forward's parameters the call leaves at their default are traced as those values (transformers'
    # `inputs_embeds=None` stays None instead of a proxy that takes its `is not None` branch).
    # The trace's forward then takes every parameter by position (torch.export runs a GraphModule's graph, whose
    # placeholders are in the signature's order): a stand-in with the model's signature passes them so.
    left = _defaults_left(model, args, kwargs)
    traced = fx.symbolic_trace(model, concrete_args=left or None)
    if left:
        sig, run = inspect.signature(model.forward), _own_forward(traced)
        plain = [n for n, p in sig.parameters.items() if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]

        def forward(*a, **k):
            bound = sig.bind(*a, **k)
            bound.apply_defaults()
            return run(*(bound.arguments[n] for n in plain))

        forward.__signature__ = sig
        traced = with_forward(traced, forward)
    return _capture_export(traced, args, kwargs)


def _defaults_left(model, args, kwargs) -> dict:
    """The forward's parameters that ``args`` and ``kwargs`` leave at a default of None, a bool, an int, a float or a
    string, with that default; none where the forward takes ``*args`` or keyword-only parameters, or where the call
    passes something into its ``**kwargs`` (transformers' forwards end with one the trace then leaves empty)."""
    try:
        sig = inspect.signature(model.forward)
        given = sig.bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return {}
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.VAR_KEYWORD)
    if any(p.kind not in kinds or (p.kind == inspect.Parameter.VAR_KEYWORD and given.get(n))
           for n, p in sig.parameters.items()):
        return {}
    return {n: p.default for n, p in sig.parameters.items() if n not in given and p.kind == kinds[0]
            and (p.default is None or type(p.default) in (bool, int, float, str))}


# ---------------------------------------------------------------------------------------------- helpers

def _lift_to_attrs(source: fx.GraphModule, attr_of: dict, keep_outputs: list[int] | None,
                   alias: dict | None = None) -> fx.GraphModule:
    """Copy ``source.graph``; placeholders named in ``attr_of`` become get_attr nodes on a fresh root
    that holds the very tensors given (shared with the user's model). get_attr nodes of ``source``
    (constants made by the tracer) keep their tensors too. ``alias``: placeholder name -> the placeholder
    whose get_attr its uses read instead."""
    graph = source.graph
    root = torch.nn.Module()
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}

    def arg(n):
        if alias and n.op == "placeholder" and alias.get(n.name, n.name) != n.name:
            n = placeholders[alias[n.name]]
        return env[n]

    for node in graph.nodes:
        if node.op == "placeholder" and node.name in attr_of:
            target, tensor = attr_of[node.name]
            _set_nested(root, target, tensor)
            env[node] = new.get_attr(target)
            env[node].meta = dict(node.meta)
            if not target.startswith("_autofuse_constants."):
                env[node].meta["autofuse_state"] = target
        elif node.op == "get_attr":
            _set_nested(root, node.target, _get_nested(source, node.target))
            env[node] = new.node_copy(node, arg)
        elif node.op == "output":
            outs = node.args[0]
            outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
            if keep_outputs is not None:
                outs = tuple(outs[i] for i in keep_outputs)
            new.output(tuple(fx.map_arg(o, arg) for o in outs))
        else:
            env[node] = new.node_copy(node, arg)
    return graph_module(root, new)


def _get_nested(mod, dotted: str):
    for p in dotted.split("."):
        mod = getattr(mod, p)
    return mod


def _set_nested(root: torch.nn.Module, dotted: str, tensor):
    *path, field = dotted.split(".")
    mod = root
    for p in path:
        if not hasattr(mod, p):
            mod.add_module(p, torch.nn.Module())
        mod = getattr(mod, p)
    if isinstance(tensor, torch.nn.Parameter):
        mod.register_parameter(field, tensor)
    elif isinstance(tensor, torch.Tensor):
        mod.register_buffer(field, tensor)
    else:
        setattr(mod, field, tensor)


#: Ops that place their input into a larger value and read no layout from it.
_SCATTERS = {torch.ops.aten.slice_scatter.default, torch.ops.aten.select_scatter.default,
             torch.ops.aten.diagonal_scatter.default, torch.ops.aten.as_strided_scatter.default}


def _differentiable_copies(gm: fx.GraphModule):
    """Item 6 of the module docstring: ``aten.copy(self, src)`` (functionalization's spelling of ``x[...] = y``
    and ``copy_``) has no derivative, so a captured graph holding one could not be trained through. It becomes
    ``src`` broadcast to ``self``'s shape and copied (``expand`` + ``clone``, or a cast to ``self``'s dtype): the
    same values, differentiable, priced alike (one copy). Only where the result's layout cannot matter: ``self``
    row-major (a clone's layout) or every reader a scatter."""
    from autofuse.graph import infer_val
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != aten.copy.default or len(node.args) != 2 or node.kwargs:
            continue
        dst, src = node.args
        d, s = dst.meta.get("val"), src.meta.get("val") if isinstance(src, fx.Node) else None
        if not (isinstance(d, torch.Tensor) and isinstance(s, torch.Tensor)) or d.device != s.device:
            continue
        if not (d.is_contiguous() or all(u.target in _SCATTERS for u in node.users)):
            continue
        with gm.graph.inserting_before(node):
            x = src
            if tuple(s.shape) != tuple(d.shape):
                x = gm.graph.call_function(aten.expand.default, (x, list(d.shape)))
                infer_val(x)
            if s.dtype != d.dtype:
                x = gm.graph.call_function(aten._to_copy.default, (x,), {"dtype": d.dtype})
            else:
                x = gm.graph.call_function(aten.clone.default, (x,))
            infer_val(x)
        for k, v in node.meta.items():
            if k != "val":
                x.meta.setdefault(k, v)
        node.replace_all_uses_with(x)
        gm.graph.erase_node(node)


def _dropped(node: fx.Node) -> bool:
    """Side-effect-only nodes: export's checks, and the profiler's ``record_function`` ranges (``nn.DataParallel``
    wraps its forward in one) that only label a profile."""
    t = node.target
    profiler = isinstance(t, torch._ops.OpOverload) and t.namespace == "profiler"
    return node.op == "call_function" and (t in _DROPPED_TARGETS or
                                           (profiler and t._opname.startswith("_record_function")))


def _cleanup(gm: fx.GraphModule):
    for node in reversed(list(gm.graph.nodes)):          # a range's exit before the enter it reads
        if _dropped(node) and not node.users:
            gm.graph.erase_node(node)
    _differentiable_copies(gm)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    missing = [n.name for n in gm.graph.nodes if n.op != "output" and "val" not in n.meta]
    if missing:
        raise CaptureError("capture", f"internal: nodes without meta['val'] after capture: {missing[:5]}")


def _specialise_data_dependent(gm: fx.GraphModule, route: str, leaves: list) -> None:
    """Item 5 of the module docstring: nodes whose sizes depend on data get the example run's sizes and the
    mark ``autofuse_data_dependent``; a no-op for a graph of static shapes."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    from autofuse.graph import NodeValues

    def symbols(v):
        try:
            return free_unbacked_symbols(v)
        except Exception:  # noqa: BLE001 - a value torch cannot walk holds no symbol of ours
            return set()

    own = {n: symbols(n.meta.get("val")) for n in gm.graph.nodes if n.op != "output"}
    if not any(own.values()):
        return
    # the nodes that read a size from data (``item``, ``tolist``, a boolean index, ``nonzero``): each symbol's first
    # holder in graph order
    source = {}
    for n, syms in own.items():
        for sym in syms:
            source.setdefault(sym, f"{n.name} ({n.target})")
    dynamic = {}
    for n, syms in own.items():
        syms = set(syms).union(*(own.get(a, set()) for a in n.all_input_nodes))
        if syms:
            dynamic[n] = tuple(sorted({source.get(s, str(s)) for s in syms}))
    first = next(iter(dynamic))
    if any(isinstance(x, torch.Tensor) and x.device.type == "meta" for x in leaves):
        raise CaptureError(route, f"capture failed on route {route!r}: the forward's sizes depend on data "
                                  f"({first.name} = {first.target}: {first.meta.get('val')!r}), which meta inputs do "
                                  f"not hold. hint: give real example inputs (the graph is then planned at the sizes "
                                  f"they produce), or use torch.compile(model, backend='autofuse').")
    fake = detect_fake_mode([v for v in (n.meta.get("val") for n in gm.graph.nodes) if isinstance(v, torch.Tensor)])

    def concrete(x):
        if isinstance(x, torch.Tensor):
            return fake.from_tensor(x, static_shapes=True) if fake is not None else x
        if isinstance(x, (list, tuple)):
            return type(x)(concrete(y) for y in x)
        return x

    wanted = {n.name: n for n in dynamic if symbols(n.meta.get("val"))}
    for name, r in NodeValues(gm, wanted).values(*leaves).items():
        wanted[name].meta["val"] = concrete(r)
    for n, why in dynamic.items():
        n.meta["autofuse_data_dependent"] = why
    for n in wanted.values():
        n.meta["autofuse_data_sized"] = True        # its own sizes change with the data (not only its inputs')


_HINTS = [
    ("Unsupported input type", "an input of the call is a Python object (not a tensor, number, string, or a list, "
                               "tuple or dict of them), which a captured graph cannot take as an input; eager runs "
                               "it, the capture cannot: pass its values as tensors or numbers, keep it on the model "
                               "as an attribute, or register its class with torch.export.register_dataclass / "
                               "torch.utils._pytree.register_pytree_node"),
    ("Cache", "the model takes or returns a KV cache object, which capture flattens with transformers' own "
              "exporter (transformers.exporters): install transformers>=5 for it, or pass use_cache=False"),
    ("data-dependent", "the model branches on or reads tensor *values* (if x.sum() > 0, .item(), .tolist(), "
                       "nonzero); use torch.where / torch.cond, or make the value a Python constant; or compile it as "
                       "it is with torch.compile(model, backend='autofuse'), which splits the graph at such a branch "
                       "and fuses each part"),
    ("control flow", "the model branches on tensor values, which symbolic_trace cannot follow; "
                     "use route='export' or rewrite with torch.where / torch.cond"),
    ("Proxy", "symbolic_trace cannot follow this Python construct; use route='export'"),
    ("which is not a known type", "the forward takes or returns an object of a class of your own, which capture "
                                  "cannot flatten into tensors: register it (torch.export.register_dataclass(Cls) "
                                  "for a dataclass, torch.utils._pytree.register_pytree_node otherwise), or use a "
                                  "tuple or dict"),
    ("found at least two devices", "the inputs and the model's parameters or buffers are on different devices: "
                                   "put them on one (with inputs on the meta device, the model too: model.to('meta'), "
                                   "or build it under torch.device('meta'))"),
]


def _check_product_dtypes(gm: fx.GraphModule, model, route: str) -> None:
    """Refuse a forward whose matmul multiplies tensors of two dtypes (an int64 or fp32 input into a float or fp16
    model): eager raises there, but the tracer's fake tensors let it through, and the plan would fail later, or
    at the first call, with torch's message about nodes."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in PRODUCTS:
            continue
        dtypes = [a.meta["val"].dtype for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if len(set(dtypes)) > 1:
            kinds = " and ".join(str(d).replace("torch.", "") for d in dict.fromkeys(dtypes))
            where = _stack_line(n.meta.get("stack_trace") or "")
            wide = [str(d).replace("torch.", "") for d in dict.fromkeys(dtypes) if d in (torch.float64,
                                                                                         torch.complex128)]
            hint = (f"cast the {wide[0]} value into the model's dtype, before the call (x.float()) or before the "
                    f"forward's first use of it (x.to(self.weight.dtype)): the NPU target computes in float16, "
                    f"bfloat16 and float32") if wide else \
                ("give example inputs in the model's dtype (x.to(torch.float16) for a model.half()), or cast the "
                 "model to the inputs'; token ids go through an embedding first")
            raise CaptureError(route, f"could not capture {type(model).__name__}: the forward multiplies {kinds} "
                                      f"tensors{f' at {where}' if where else ''}, which eager refuses too (mat1 and "
                                      f"mat2 must have the same dtype). hint: {hint}")


def _dtensors(model, inputs) -> str:
    """``"the parameters a, b are"`` (or the buffers, the inputs) where the model or the call holds DTensors, else
    ``""``: checked before tracing, whose failures on them say nothing of DTensor (an empty AssertionError from
    export, "invalid python storage", or a tracer's hint about branches)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return ""
    for what, named in (("parameters", model.named_parameters()), ("buffers", model.named_buffers())):
        names = [n for n, t in named if isinstance(t, DTensor)]
        if names:
            return f"the model's {what} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''} are"
    if any(isinstance(x, DTensor) for x in pytree.tree_leaves(inputs)):
        # Dynamo hands a graph the model's parameters as inputs
        return "the graph's inputs (the model's parameters among them) are" if _dynamo_graph(model) else \
            "the call's inputs are"
    return ""


#: torch's packages of quantized layers (eager-mode quantization: quantize_dynamic, convert)
_QUANTIZED_PACKAGES = ("torch.ao.nn.quantized", "torch.nn.quantized", "torch.ao.nn.intrinsic.quantized",
                       "torch.nn.intrinsic.quantized")


def _quantized_layers(model) -> list:
    """``"path (Layer)"`` of each layer of ``model`` that holds quantized weights: packed parameters in a
    TorchScript object (the ``torch.classes.quantized.*PackedParamsBase`` of ``torch.ao.nn.quantized`` and
    ``quantized.dynamic`` layers) or a quantized tensor. Named by the outermost layer of torch's quantized
    packages around the holder (``l1 (DynamicQuantizedLinear)``, not its ``_packed_params``), else the holder."""
    if not isinstance(model, torch.nn.Module):
        return []
    modules = dict(model.named_modules())
    holders = []
    for name, m in modules.items():
        own = [*vars(m).values(), *m._parameters.values(), *m._buffers.values()]
        if any(isinstance(v, torch.ScriptObject) or isinstance(v, torch.Tensor) and v.is_quantized for v in own):
            holders.append(name)
    found = {}
    for name in holders:
        parts = name.split(".") if name else []
        prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        outer = next((p for p in prefixes if type(modules[p]).__module__.startswith(_QUANTIZED_PACKAGES)), name)
        found[outer] = f"{outer or 'the model itself'} ({modules[outer]._get_name()})"
    return list(found.values())


def _quantized_explanation(model, layers, failures) -> str:
    """Why a model with quantized layers could not be captured, naming them, and what to do instead."""
    shown = ", ".join(layers[:6]) + (f" and {len(layers) - 6} more" if len(layers) > 6 else "")
    routes = "; ".join(f"route '{r}': {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
                       for r, e in failures)
    return (f"could not capture {type(model).__name__}: it holds quantized layers, {shown}, whose weights are "
            f"packed parameters (torch.ao.quantization's quantize_dynamic or convert made them), which torch's "
            f"tracers cannot capture ({routes}). hint: fuse the float model (as it was before quantize_dynamic / "
            f"convert) instead; or keep the quantized weight as a plain int8 buffer with its scale and write the "
            f"dequantisation in torch ops, F.linear(x, w_int8.to(x.dtype) * scale, bias), which autofuse captures "
            f"and fuses")


def _stack_line(stack: str) -> str:
    """The innermost frame of a node's ``stack_trace`` outside torch and autofuse: ``file:line: code``."""
    lines = stack.strip().splitlines()
    frames = [(i, ln.strip()) for i, ln in enumerate(lines) if ln.strip().startswith("File ")]
    for i, frame in reversed(frames):
        m = re.match(r'File "([^"]+)", line (\d+)', frame)
        if m and not os.path.abspath(m.group(1)).startswith((_TORCH_DIR.rstrip(os.sep), _OWN_DIR)):
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{m.group(1)}:{m.group(2)}: {code}"
    return ""


def _dynamo_graph(model) -> bool:
    """Whether ``model`` is a graph Dynamo captured (``torch.compile``'s backend is handed one)."""
    return isinstance(model, fx.GraphModule) and "dynamo_compile_id" in getattr(model, "meta", {})


def _program_hint(failures) -> str:
    """What to do when an exported program's module refuses a call's inputs (its guards, or its code on an input
    of another kind than the export's)."""
    text = " ".join(str(e) for _, e in failures)
    if "Guard failed" in text and re.search(r"\.size\(\)|\.shape|\.stride\(\)", text):
        return ("the exported program refuses these inputs' sizes (torch.export checks the guards it recorded: "
                "the ranges of its dimensions, and any branch the forward took on a size; its own module, "
                "ep.module(), refuses them too): export again with dynamic_shapes= giving that dimension a "
                "torch.export.Dim (or Dim.AUTO) whose range holds this size; where the forward branches on the size "
                "(T % 2, T == 5), the program does not hold what eager computes at these sizes: export again at "
                "these sizes, or fuse the nn.Module itself")
    if "Guard failed" in text:
        return ("the exported program refuses this call's Python value (torch.export kept the value it was "
                "exported with as a constant, and its own module, ep.module(), refuses another): export again with "
                "this value, or pass it as a tensor if it changes between calls")
    return ("the exported program fails on these inputs, as its own module (ep.module()) does: give the inputs "
            "it was exported with (the same kinds: a tensor where it took a tensor, None where it took None), or "
            "export again with these inputs (dynamic_shapes= for sizes that change)")


def _capture_error(route, model, failures, drawn: str | None = None) -> CaptureError:
    """The error for ``failures`` (every route's ``(route, exception)``): :func:`_explain`'s message, and the
    arguments the forward builds only outside compilation and the capture met as None (each failure's traceback
    read once, for both)."""
    skipped = [_default_skipped_when_compiling(e) for _, e in failures]
    return CaptureError(route, _explain(model, failures, drawn, skipped),
                        tuple(dict.fromkeys(s[1] for s in skipped if s)))


def _explain(model, failures, drawn: str | None, skipped: list) -> str:
    """Why every route failed, and what to do. ``drawn``: the host generators the forward draws from
    (:func:`_host_rng_drawn`), which no capture can keep and the message leads with; where numpy's is one, a hint
    that points to torch.compile says what makes its draws eager's. ``skipped``: each failure's argument built
    only outside compilation (:func:`_default_skipped_when_compiling`), or None."""
    program = program_module(model)
    dynamo = _dynamo_graph(model)
    what = ("the exported program's module (fuse() of an ExportedProgram runs ep.module())" if program else
            "Dynamo's graph (GraphModule)" if dynamo else type(model).__name__)
    lines = [f"could not capture {what}:"]
    if drawn:
        lines = [f"could not capture {what}: {_host_draw_text(drawn)}.",
                 "  Besides, every capture route failed (what follows applies once the draws are out of the forward):"]
    hinted = False
    for (route, e), default in zip(failures, skipped):
        text = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        lines.append(f"  route '{route}' failed with {text}")
        where = _user_frame(e)
        if where and not (program and where.startswith("<string>")):    # not the program's own guard function
            lines.append(f"    at {where}")
        hint = next((h for key, h in _HINTS if key in str(e) or key in type(e).__name__), None)
        inside = _torch_module_frame(e)
        if inside:
            lines.append(f"    inside torch's own module code at {inside}")
            if "data-dependent" in str(e):
                hint = ("torch's own module code reads a tensor value there, which its arguments decide (a "
                        "BatchNorm with momentum=None reads its batch count; a TransformerEncoder given a mask "
                        "without is_causal inspects the mask; a FakeQuantize reads its enable flags): set the "
                        "argument that avoids the read, or compile the model with torch.compile(model, "
                        "backend='autofuse'), which runs it with a graph break")
        if isinstance(e, TypeError) and any(k in str(e) for k in _SIGNATURE_ERRORS):
            hint = _signature_hint(model)
        if default:
            hint = (f"{default[0]} builds a default {default[1]} only when not compiling (`if {default[1]} is None "
                    f"and not is_torchdynamo_compiling()`), and torch.export is compiling, so the capture went on "
                    f"with None where eager has a value: pass {default[1]} in the example inputs (and in each "
                    f"call), as eager would have built it (an attention mask of ones: "
                    f"attention_mask=torch.ones_like(input_ids)); or compile the model with "
                    f"torch.compile(model, backend='autofuse')")
        if hint and drawn and "numpy" in drawn:
            hint = hint.replace("torch.compile(model, backend='autofuse')",
                                "torch.compile(model, backend='autofuse') with "
                                "torch._dynamo.config.use_numpy_random_stream = True (see above)")
        if hint:
            lines.append(f"    hint: {hint}")
            hinted = True
    firsts = {(type(e).__name__, (str(e).strip().splitlines() or [""])[0]) for _, e in failures}
    if program and not hinted:
        lines.append(f"  hint: {_program_hint(failures)}.")
    elif len(failures) > 1 and len(firsts) == 1 and not hinted and not dynamo and \
            all(_raised_in_forward(e) for _, e in failures):
        # every tracer stopped at the same error, raised in the forward's own code (the user's, or a torch layer's
        # forward): the forward itself raises it on these inputs
        lines.append("  hint: every route failed with the same error, which the forward raises on these inputs "
                     "itself: run model(*example_inputs) eagerly to see it, and fix the model or the inputs.")
    elif len(failures) > 1 and len(firsts) == 1 and not hinted:
        # raised inside torch's tracing machinery (or for a graph Dynamo already ran): not the model's error
        if dynamo:
            lines.append("  hint: every route failed with the same error, raised inside torch's tracing machinery "
                         "(no frame of the model's code is in its traceback) on a graph Dynamo traced from these "
                         "inputs already: a limitation of autofuse's capture, not a fault of the model; please "
                         "report it to autofuse with the model.")
        else:
            lines.append("  hint: every route failed with the same error, raised inside torch's tracing machinery "
                         "(no frame of the model's code is in its traceback), so it need not be the model's own: "
                         "run model(*example_inputs) eagerly; if that runs, this is a limitation of autofuse's "
                         "capture: please report it to autofuse with the model.")
    elif not hinted:
        lines.append("  hint: the failing construct is named above; route='export' handles most models, "
                     "route='symbolic_trace' only plain modules without value-dependent Python control flow.")
    return "\n".join(lines)


#: what Python's argument binding says when the example inputs do not fit the forward's parameters
_SIGNATURE_ERRORS = ("too many positional arguments", "missing a required argument", "unexpected keyword argument",
                     "multiple values for argument")


def _signature_hint(model) -> str:
    import inspect
    try:
        sig = f"forward{inspect.signature(model.forward)}"
    except (TypeError, ValueError, AttributeError):
        sig = "the forward's parameters"
    return (f"the example inputs do not fit {sig}: give one positional input per parameter in order, or "
            f"(args, kwargs) with keyword inputs by name")


def _raised_in_forward(e: BaseException) -> bool:
    """Whether the error was raised while the forward's own code ran: a frame of the user's code, of torch's
    layers and functionals (``torch/nn``, not ``Module.__call__``), or of fx's ``Interpreter`` running a node of a
    GraphModule's graph (how torch.export runs one) is in its traceback. An error raised by torch's tracing
    machinery alone (its guards, its shape environment) has none: the forward need not raise it."""
    interpreter = os.path.join(_TORCH_DIR, "fx", "interpreter.py")
    for f in traceback.extract_tb(e.__traceback__):
        if _users_file(f.filename) or os.path.abspath(f.filename) == interpreter and f.name == "run_node":
            return True
        if _torch_module_code(f.filename):
            return True
    return False


#: torch's layers and functionals (torch.nn) and its quantization modules (torch.ao: FakeQuantize, observers)
_TORCH_MODULE_DIRS = tuple(os.path.join(_TORCH_DIR, d) + os.sep for d in ("nn", "ao"))


def _torch_module_code(filename: str) -> bool:
    """Whether ``filename`` is torch's own module code (a layer's forward, a functional), not ``Module.__call__``."""
    return os.path.abspath(filename).startswith(_TORCH_MODULE_DIRS) and \
        not filename.endswith(os.path.join("modules", "module.py"))


def _torch_module_frame(e: BaseException) -> str | None:
    """Where torch's own module code (``torch/nn``: a layer's forward, its functional; ``torch/ao``: a FakeQuantize,
    an observer) failed, below the user's innermost frame; None where the failure is not inside such code."""
    frames = traceback.extract_tb(e.__traceback__)
    user = [i for i, f in enumerate(frames) if _users_file(f.filename)]
    inside = [i for i, f in enumerate(frames) if _torch_module_code(f.filename)]
    if not inside or (user and inside[-1] < user[-1]):
        return None
    f = frames[inside[-1]]
    return f"torch/{os.path.relpath(f.filename, _TORCH_DIR)}:{f.lineno} in {f.name}: {f.line}"


def _defaults_built_when_eager(source: str) -> set[str]:
    """The names a function's ``source`` gives a value only outside compilation: ``if NAME is None and not
    is_torchdynamo_compiling(): NAME = ...`` (the call under any module prefix, the name assigned in the body)."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return set()
    names = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.BoolOp) and isinstance(node.test.op, ast.And)
                and len(node.test.values) == 2):
            continue
        none, compiling = node.test.values
        if not (isinstance(none, ast.Compare) and isinstance(none.left, ast.Name) and len(none.ops) == 1
                and isinstance(none.ops[0], ast.Is) and isinstance(none.comparators[0], ast.Constant)
                and none.comparators[0].value is None):
            continue
        if not (isinstance(compiling, ast.UnaryOp) and isinstance(compiling.op, ast.Not)
                and isinstance(compiling.operand, ast.Call)
                and ast.unparse(compiling.operand.func).split(".")[-1] == "is_torchdynamo_compiling"):
            continue
        if any(isinstance(t, ast.Name) and t.id == none.left.id for stmt in node.body for t in ast.walk(stmt)
               if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)):
            names.add(none.left.id)
    return names


def _default_skipped_when_compiling(e: BaseException) -> tuple[str, str] | None:
    """``(function, argument)`` where a frame of ``e``'s traceback (the user's or a library's code) fills in a
    default for an argument only outside compilation (transformers' LongT5 and SwitchTransformers stacks:
    ``if attention_mask is None and not is_torchdynamo_compiling(): attention_mask = torch.ones(...)``) and that
    argument was still None when the capture failed; else None."""
    tb = e.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if _users_file(frame.f_code.co_filename):
            try:
                source = "".join(inspect.getsourcelines(frame.f_code)[0])
            except (OSError, TypeError):
                source = ""
            for name in sorted(_defaults_built_when_eager(source)) if "is_torchdynamo_compiling" in source else ():
                if name in frame.f_locals and frame.f_locals[name] is None:
                    owner = frame.f_locals.get("self")
                    where = f"{type(owner).__name__}.{frame.f_code.co_name}" if owner is not None else \
                        frame.f_code.co_name
                    return where, name
        tb = tb.tb_next
    return None


def _user_frame(e: BaseException) -> str | None:
    """The innermost traceback frame outside torch, autofuse and Python's own library: the user's construct that
    failed."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if _users_file(f.filename)]
    if not frames:
        return None
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {f.line}"


def _users_file(filename: str) -> bool:
    """Whether a traceback frame's file is the user's (or a library's) code: not torch's, autofuse's or Python's
    own library."""
    return not os.path.abspath(filename).startswith((_TORCH_DIR.rstrip(os.sep), _OWN_DIR, _STDLIB_DIR))

