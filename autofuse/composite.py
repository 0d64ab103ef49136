"""The context in which one trace keeps torch's composite ops whole, at a lower price than torch's own.

Capture traces a model once, straight to functional aten, with composite ops (``CompositeImplicitAutograd``:
``linear``, ``layer_norm``, ``scaled_dot_product_attention``...) preserved as ``run_decompositions({})`` preserves
them (:func:`autofuse.capture._export_functional`). torch does that in two steps, each of which it repeats at every
export, and which together cost about as much as tracing a small model:

1. ``_split_decomp_table_to_cia_and_python_decomp({})`` lists the 525 preservable composite ops of this torch by
   walking every op namespace, and asks the C++ dispatcher for every composite op again for each namespace
   to make sure each is materialised in ``torch.ops``.
2. ``_override_composite_implicit_decomp`` patches those ops for the trace: for each, 22 Python kernels set
   through ``OpOverload.py_impl``, whose decorator builds two ``Callable[_P, _T]`` annotations at every call; then
   puts them back.

On this machine kind those took 27 ms and 80 ms per export (see benchmarks/compile_time.py for fuse()'s time).
This module does the same work for less:

* :func:`preserved_ops` keeps the list of step 1 while the dispatcher's composite registrations and the op
  namespaces (and their ops) are unchanged; a custom op registered later is a new registration, which lists them
  again. The one change it does not see is a Python-only composite kernel (``py_impl(CompositeImplicitAutograd)``)
  added to an op after the first capture, which torch itself does only at import.
* :func:`keep_composites` sets step 2's kernels straight in each op's ``py_kernels`` (what ``py_impl`` does for a
  key not yet set, the only keys torch's function sets), with torch's own helpers for everything else. It does what
  torch's function does, with two differences: each op's autograd kernel (a closure over the op) is made once and
  shared between traces, and the ops are put back also when setting them fails half-way. It is used only while
  torch's function is the one it mirrors (its source's digest, :data:`MIRRORED`); with any other torch, torch's
  own context runs. tests/test_capture.py checks that both leave every op's kernels alike, during the trace and
  after it, and that the graphs are the same.

Like torch's, the context changes process-wide state (the ops' kernels) and is not for two threads at once:
autofuse makes one plan at a time in a process, while no other thread runs one (``autofuse.engine._PLANNING``).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect

import torch

#: the digest of torch's ``_override_composite_implicit_decomp`` source that :func:`keep_composites` mirrors
#: (torch 2.13.0)
MIRRORED = "4422dc79d0792af728dd8eacf0a2fadcf00195c8802ceca15632b737d9d5c9bd"

_preserved: dict = {}

#: composite ops that update an input in place but whose schema and tags say nothing of it, so torch preserves them as
#: functional: ``instance_norm`` given running statistics in training writes them (its batch_norm inside does), and a
#: graph that kept it whole would leave the update to whichever kernel runs it (a fused one does not). Decomposed,
#: the update is the functional batch_norm's, which the export returns as a buffer mutation.
MUTATING_UNTAGGED = (torch.ops.aten.instance_norm.default,)


def preserved_ops() -> dict:
    """``{op: torch's marker to preserve it}`` for every composite op a trace may keep whole: torch's
    ``_split_decomp_table_to_cia_and_python_decomp({})[0]``, listed again only when the dispatcher's composite
    registrations or ``torch.ops``' namespaces and their ops changed, but :data:`MUTATING_UNTAGGED`."""
    from torch.export.exported_program import _split_decomp_table_to_cia_and_python_decomp
    if _preserved.get("key") != _registry():
        _preserved["ops"] = _split_decomp_table_to_cia_and_python_decomp({})[0]
        # listing materialises ops in torch.ops: the key is read after it, as the next call will see it
        _preserved["key"] = _registry()
    return {op: mark for op, mark in _preserved["ops"].items() if op not in MUTATING_UNTAGGED}


def _registry() -> tuple:
    """What the list of preservable ops depends on: the dispatcher's composite registrations, and ``torch.ops``'
    namespaces with their ops (aten's are fixed)."""
    registered = frozenset(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd"))
    return registered, tuple((name, tuple(getattr(torch.ops, name)) if name != "aten" else ())
                             for name in sorted(torch.ops._dir))


@functools.cache
def torch_has_composite_context() -> bool:
    """Whether this torch has the two functions the one-trace capture uses (else it exports and decomposes in two
    traces, torch's public path)."""
    from torch.export import exported_program
    return all(hasattr(exported_program, name) for name in ("_override_composite_implicit_decomp",
                                                             "_split_decomp_table_to_cia_and_python_decomp"))


@functools.cache
def mirrors_torch() -> bool:
    """Whether torch's ``_override_composite_implicit_decomp`` is the function :func:`keep_composites` mirrors."""
    try:
        from torch.export.exported_program import _override_composite_implicit_decomp
        source = inspect.getsource(_override_composite_implicit_decomp)
    except (ImportError, OSError, TypeError):
        return False
    return hashlib.sha256(source.encode()).hexdigest() == MIRRORED


def keep_composites(ops: dict):
    """The context a trace keeps ``ops`` (op -> its decomposition, or torch's marker to preserve it) in: torch's
    ``_override_composite_implicit_decomp(ops)``, by :func:`_kept` where torch's function is the one mirrored."""
    from torch.export.exported_program import _override_composite_implicit_decomp
    return _kept(ops) if mirrors_torch() else _override_composite_implicit_decomp(ops)


def _dispatch_to_original(fake_tensor_mode, op, *args, original_callable=None, **kwargs):
    """The fake-tensor rule torch registers for a kept op: its original composite kernel, under the fake mode."""
    with fake_tensor_mode:
        return original_callable(*args, **kwargs)


#: each op's autograd kernel while it is kept (torch's ``autograd_not_implemented(op, deferred_error=True)``, a
#: closure over the op alone), made once: 6,300 new closures per trace would wake the garbage collector, whose
#: passes over a process holding torch cost more than the rest of this context
_refusals: dict = {}


@contextlib.contextmanager
def _kept(ops: dict):
    """torch 2.13's ``_override_composite_implicit_decomp``, each kernel set in ``py_kernels`` directly and one
    autograd kernel per op shared between traces."""
    from torch._export.utils import _get_decomp_for_cia
    from torch._higher_order_ops.utils import autograd_not_implemented
    from torch._subclasses.fake_impls import _deregister_op_impl, _is_op_registered_to_fake_rule, register_op_impl
    from torch.export.exported_program import _AUTOGRAD_ALIAS_BACKEND_KEYS_TO_OVERRIDE, _BACKEND_KEYS_TO_OVERRIDE
    cia = torch._C.DispatchKey.CompositeImplicitAutograd
    saved = {}
    try:
        for op, decomposition in ops.items():
            saved[op] = op.py_kernels.copy()
            kernels = op.py_kernels
            refusal = _refusals.get(op)
            if refusal is None:
                refusal = _refusals[op] = autograd_not_implemented(op, deferred_error=True)
            for key in _AUTOGRAD_ALIAS_BACKEND_KEYS_TO_OVERRIDE:
                if key not in kernels:
                    kernels[key] = refusal
            original = _get_decomp_for_cia(op)      # after the autograd keys, before the composite key: as torch
            kernels.pop(cia, None)
            kernels[cia] = decomposition
            if not _is_op_registered_to_fake_rule(op):
                register_op_impl(op)(functools.partial(_dispatch_to_original, original_callable=original))
            for key in _BACKEND_KEYS_TO_OVERRIDE:
                if key not in kernels:
                    kernels[key] = original
            op._dispatch_cache.clear()
        yield
    finally:
        for op, before in saved.items():
            op.py_kernels.clear()
            op.py_kernels.update(before)
            op._dispatch_cache.clear()
            _deregister_op_impl(op)
