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
export of the step specialised to the length (:mod:`autofuse.sizes`), not a new export.

A sliding-window layer of a dynamic cache (``DynamicSlidingWindowLayer``: Mistral, Gemma 2/3 and the other models
with local attention) also keeps its length as a Python int (``cumulative_length``), which transformers' flatten
puts into the captured structure: every decode step would be a new structure, exported by itself. While the
window is not yet full that int is the length of the layer's keys, and capture flattens it as that
(:func:`lengths_tied`): the structure says "the keys' length" instead of the number, so the decode steps share
one structure and one symbolic export, where the length is a size like any other. Past the window the keys stop
growing and the int does not: each step keeps its own structure, exported by itself.

A static cache (``StaticCache``) keeps its size: the forward writes the new keys and values into its tensors in
place (``index_copy_``), which capture turns into new values the fused call copies back into the caller's tensors
(:mod:`autofuse.capture`, item 7), so every decode step has one signature and one plan. Its sliding-window layers
(``StaticSlidingWindowLayer``) keep their length as a Python int too, which no tensor's size holds (their keys
keep the window's size): a model with them is exported and planned at every step.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree


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
    _tie_lengths_in_registered()
    return True


def has_windowed_layers(config) -> bool:
    """Whether a model with this config makes caches with sliding-window or chunked layers (transformers' own
    reading of the config); False where it cannot tell."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
        types, _ = get_layer_types_and_kwargs(config)
    except Exception:  # noqa: BLE001 - no config, or an older transformers: nothing known of its layers
        return False
    return any(t in ("sliding_attention", "chunked_attention", "hybrid_sliding") for t in types)


# -- lengths tied to the keys they count -------------------------------------------------------------------------

#: Whether a flatten of a cache, now, writes a sliding-window layer's length as its keys' length (lengths_tied).
_TIED = contextvars.ContextVar("autofuse_cache_lengths_tied", default=False)

#: The structure's mark for "this int is that leaf's size along that dim" (JSON, as transformers' other marks).
_LENGTH = "autofuse.length"


@contextlib.contextmanager
def lengths_tied(model=None):
    """While capture flattens inputs and outputs (and while a captured graph's inputs are flattened again to run
    it): a ``DynamicSlidingWindowLayer`` whose ``cumulative_length`` equals its keys' length is flattened with that
    int written as "the keys' length along dim -2", and unflattened with the length read from the keys (a size,
    symbolic where the export's sizes are). Off for a model that is an exported program's module: its forward
    checks the structure it was exported with, in which the number stands. Outside this block flattening is
    transformers' own, so a ``torch.export`` of the user's elsewhere in the process gives the structure it gave."""
    on = not (isinstance(model, fx.GraphModule) and isinstance(getattr(model, "_in_spec", None), pytree.TreeSpec))
    token = _TIED.set(on)
    try:
        yield on
    finally:
        _TIED.reset(token)


@contextlib.contextmanager
def tied_as(on: bool):
    """Flattening as it was when a structure was captured (``Captured.tied``)."""
    token = _TIED.set(on)
    try:
        yield
    finally:
        _TIED.reset(token)


def _sliding_layer_class():
    try:
        from transformers.cache_utils import DynamicSlidingWindowLayer
    except Exception:  # noqa: BLE001 - an older transformers: no such layer to tie
        return None
    return DynamicSlidingWindowLayer


def _class_at(path: str):
    module, _, name = path.partition(":")
    import importlib
    try:
        return getattr(importlib.import_module(module), name, None)
    except Exception:  # noqa: BLE001 - a class that cannot be found is not one to tie
        return None


def _tie(ctx, leaves, dropped: list):
    """``ctx`` (transformers' JSON context of a cache) with each tied length marked (see lengths_tied). A length
    that is already a leaf (a SymInt while export traces, equal to the keys' symbolic length) is marked too, and
    its leaf index appended to ``dropped``."""
    if isinstance(ctx, list):
        return [_tie(c, leaves, dropped) for c in ctx]
    if not isinstance(ctx, dict):
        return ctx
    if ctx.get("_t") != "obj":
        return {k: _tie(v, leaves, dropped) for k, v in ctx.items()}
    state = {k: _tie(v, leaves, dropped) for k, v in ctx["s"].items()}
    sliding, cls = _sliding_layer_class(), _class_at(ctx["p"])
    keys, n = state.get("keys"), state.get("cumulative_length")
    if sliding is not None and isinstance(cls, type) and issubclass(cls, sliding) and isinstance(keys, dict) \
            and keys.get("_t") == "tensor":
        shape = getattr(leaves[keys["i"]], "shape", ())
        length = shape[-2] if len(shape) >= 2 else None
        mark = {"_t": _LENGTH, "i": keys["i"], "d": -2}
        if type(n) is int and type(length) is int and n == length:
            state["cumulative_length"] = mark
        elif isinstance(n, dict) and n.get("_t") == "sym" and isinstance(length, torch.SymInt):
            value = leaves[n["i"]]
            if isinstance(value, torch.SymInt) and value.node.expr == length.node.expr:
                state["cumulative_length"] = mark
                dropped.append(n["i"])
    return dict(ctx, s=state)


def _renumber(ctx, gone: int):
    """``ctx`` with every leaf index past ``gone`` one less (the leaf ``gone`` was dropped)."""
    if isinstance(ctx, list):
        return [_renumber(c, gone) for c in ctx]
    if not isinstance(ctx, dict):
        return ctx
    if ctx.get("_t") in ("tensor", "sym", _LENGTH) and type(ctx.get("i")) is int:
        return dict(ctx, i=ctx["i"] - (ctx["i"] > gone))
    return {k: _renumber(v, gone) for k, v in ctx.items()}


def _untie(ctx, values: list):
    """``ctx`` with each length mark replaced by transformers' mark for a leaf, the size appended to ``values``."""
    if isinstance(ctx, list):
        return [_untie(c, values) for c in ctx]
    if not isinstance(ctx, dict):
        return ctx
    if ctx.get("_t") == _LENGTH:
        shape = getattr(values[ctx["i"]], "shape", None)
        values.append(None if shape is None else shape[ctx["d"]])
        return {"_t": "sym", "i": len(values) - 1}
    return {k: _untie(v, values) for k, v in ctx.items()}


def _tied_node(base):
    """A pytree node definition of transformers' ``base`` whose flatten ties lengths inside :func:`lengths_tied`
    and whose unflatten reads a tied length wherever it is marked."""
    def flatten(obj):
        leaves, ctx = base.flatten_fn(obj)
        if not _TIED.get():
            return leaves, ctx
        dropped: list = []
        ctx = _tie(ctx, leaves, dropped)
        for i in sorted(dropped, reverse=True):
            del leaves[i]
            ctx = _renumber(ctx, i)
        return leaves, ctx

    def flatten_with_keys(obj):
        leaves, ctx = flatten(obj)
        return [(pytree.SequenceKey(i), leaf) for i, leaf in enumerate(leaves)], ctx

    def unflatten(values, ctx):
        values = list(values)
        return base.unflatten_fn(values, _untie(ctx, values))

    return pytree.NodeDef(base.type, flatten, unflatten, flatten_with_keys)


def _tie_lengths_in_registered() -> None:
    """Wrap the pytree nodes transformers' exporter registered (:func:`_tied_node`), once each. torch's registry
    has no replace: its entry is swapped under torch's registry lock."""
    try:
        from transformers.exporters.exporter_dynamo import _pytree_flatten
    except Exception:  # noqa: BLE001 - another exporter: its structures are left as they are
        return
    with pytree._NODE_REGISTRY_LOCK:
        for cls, node in list(pytree.SUPPORTED_NODES.items()):
            if node.flatten_fn is _pytree_flatten:
                pytree.SUPPORTED_NODES[cls] = _tied_node(node)


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


__all__ = ["adopt", "caches_in", "has_windowed_layers", "is_cache", "lengths_tied", "prepare", "tied_as"]
