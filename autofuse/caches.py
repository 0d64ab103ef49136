"""KV caches: a model that takes or returns one (transformers' ``DynamicCache`` and the other ``Cache`` classes)
is captured and runs fused as eager runs it.

**Capture.** A cache is a Python object holding tensors, which ``torch.export`` accepts as an input or output only
once it is a pytree node. Before capturing a transformers model, or a model called with a cache, autofuse
registers transformers' cache classes as pytree nodes with transformers' own exporter
(``transformers.exporters.exporter_dynamo.register_cache_pytrees_for_model``, as ``transformers``' export does):
a cache's tensors become graph inputs and outputs, its other state part of the captured structure. The
registration is process-wide (torch's pytree registry is global), like transformers' own.

**Run.** Eager updates the cache it is given in place (each layer's keys and values are replaced by the longer
ones) and returns that same object. The captured graph instead returns the new tensors, which the captured
structure rebuilds into a new cache object. :func:`adopt` makes the fused call behave as eager: the new state is
moved into the caller's cache object, object by object (the cache, then each of its layers), and that object is
returned in the new one's place. A fresh cache (a prefill without one) is returned as built, as eager builds it.

**Signatures.** A dynamic cache's length is part of its tensors' shapes, so each decode step is a new input
signature: ``fuse()`` plans it as it plans any new signature (capture, plan, verification), once per length; from
the third length on (the second, in a generate() with five or more decode steps to make), the capture is a symbolic
export of the step specialised to the length (:mod:`autofuse.sizes`), not a new export. A
static cache (``StaticCache``) keeps its size: the forward writes the new keys and values into its tensors in
place (``index_copy_``), which capture turns into new values the fused call copies back into the caller's tensors
(:mod:`autofuse.capture`, item 7), so every decode step has one signature and one plan. Its sliding-window layers
keep their length as a Python int in the cache's structure, so a model with them is planned per step.
"""
from __future__ import annotations

from typing import Any

import torch


def _cache_base():
    try:
        from transformers.cache_utils import Cache
    except Exception:  # noqa: BLE001 - transformers absent or too old: no cache class to know
        return None
    return Cache


def is_cache(obj) -> bool:
    base = _cache_base()
    return base is not None and isinstance(obj, base)


def _walk(obj, seen=None):
    """The caches inside ``obj`` (arguments, keyword arguments or an output), in order: containers (tuples, lists,
    dicts and transformers' ``ModelOutput``) are searched, caches are not entered."""
    if seen is None:
        seen = set()
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if is_cache(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _walk(v, seen)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _walk(v, seen)


def caches_in(obj) -> list:
    return list(_walk(obj))


def prepare(model: torch.nn.Module, args=(), kwargs=None) -> bool:
    """Register transformers' cache classes as pytree nodes when ``model`` is a transformers model or is called
    with a cache (see the module docstring). Returns whether they are registered."""
    from_transformers = type(model).__module__.startswith("transformers.")
    if not (from_transformers or caches_in((args, kwargs or {}))):
        return False
    try:
        from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model
    except Exception:  # noqa: BLE001 - an older transformers: capture says what failed, with its hint
        return False
    register_cache_pytrees_for_model(model)
    return True


def _move_state(dst, src) -> None:
    """Give ``dst`` the state of ``src`` (an object of the same type), keeping ``dst``'s own sub-objects where
    ``src`` has sub-objects of the same types in the same places (a cache's layers), so that references the
    caller holds to them see the update as eager's in-place update would show it."""
    for k, v in vars(src).items():
        old = vars(dst).get(k)
        if isinstance(v, list) and isinstance(old, list) and len(v) == len(old) and all(
                _same_kind(a, b) for a, b in zip(old, v)):
            for a, b in zip(old, v):
                if a is not b:
                    _move_state(a, b)
        elif _same_kind(old, v) and old is not v:
            _move_state(old, v)
        else:
            setattr(dst, k, v)


def _same_kind(a, b) -> bool:
    """Two plain Python objects of one class whose state can move from one to the other (not tensors, not
    builtins)."""
    return (type(a) is type(b) and hasattr(a, "__dict__") and not isinstance(a, (torch.Tensor, type))
            and not isinstance(a, (list, tuple, dict)))


def _replace(obj, old, new):
    """``obj`` with the object ``old`` replaced by ``new`` wherever it appears in containers."""
    if obj is old:
        return new
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            r = _replace(v, old, new)
            if r is not v:
                obj[k] = r            # transformers' ModelOutput sets the attribute as well
        return obj
    if isinstance(obj, (tuple, list)):
        items = [_replace(v, old, new) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        if isinstance(obj, list):
            obj[:] = items
            return obj
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def adopt(inputs: Any, output: Any) -> Any:
    """``output`` of a fused call whose ``inputs`` held caches, as eager returns it: each input cache takes the
    state of the output cache of its type (in order) and stands in its place (see the module docstring)."""
    given = caches_in(inputs)
    if not given:
        return output
    made = caches_in(output)
    for cache in given:
        twin = next((c for c in made if type(c) is type(cache)), None)
        if twin is None:
            continue
        made.remove(twin)
        _move_state(cache, twin)
        output = _replace(output, twin, cache)
    return output


__all__ = ["adopt", "caches_in", "is_cache", "prepare"]
