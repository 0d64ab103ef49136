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

A sliding-window layer (``DynamicSlidingWindowLayer``, ``StaticSlidingWindowLayer``: Mistral, Gemma 2/3 and the
other models with local attention) also keeps its length as a Python int, which transformers' flatten writes into
the captured structure: every decode step would be a new structure, exported by itself. Capture writes that length
as a size instead (:func:`lengths_tied`): while a dynamic layer's window is not full, as its keys' length; past the
window, and in a static layer (whose keys keep the window's size), as an input of its own (a :class:`Length` leaf),
which a symbolic export keeps symbolic as it keeps a tensor's size. The decode steps then share one structure and
one symbolic export (:mod:`autofuse.sizes`), and the forward's branches on the length (the window full or not)
are guards of that export, checked at each step.

A static cache (``StaticCache``) keeps its size: the forward writes the new keys and values into its tensors in
place (``index_copy_``), which capture turns into new values the fused call copies back into the caller's tensors
(:mod:`autofuse.capture`, item 7), so every decode step has one signature and one plan. Where it has
sliding-window layers, their length is part of each step's signature (an input the graph may compute with: the
mask's offset past the window); a step whose capture is an earlier step's plan's own but for the new length the
graph returns is served by that plan (``engine.graph_changes``, ``Plan.with_outputs``), so such a model plans its
first decode steps, not every one.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import torch
import torch.utils._pytree as pytree

from autofuse.graph import program_module


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


# -- a sliding-window layer's length: its keys' length, or a leaf of its own ------------------------------------

#: Whether a flatten of a cache, now, writes sliding-window layers' lengths as sizes (lengths_tied).
_TIED = contextvars.ContextVar("autofuse_cache_lengths_tied", default=False)

#: The structure's mark for "this int is that leaf's size along that dim" (JSON, as transformers' other marks).
_LENGTH = "autofuse.length"

#: Whether lifted lengths are flattened as plain ints (:func:`plain_lengths`: what torch.export is handed).
_PLAIN = contextvars.ContextVar("autofuse_cache_lengths_plain", default=False)

#: What a layer's length reads while transformers flattens its cache (a JSON string it keeps as it is), then
#: replaced in the structure by the length's mark.
_PLACE = "autofuse.length-of-layer-"


@contextlib.contextmanager
def _setting(var, value):
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def lengths_tied(model=None):
    """While capture flattens inputs and outputs (and while a captured graph's inputs are flattened again to run
    it), each sliding-window layer's length is written as a size, not as a number of the structure:

    - a ``DynamicSlidingWindowLayer`` whose ``cumulative_length`` equals its keys' length (its window not yet full)
      as "the keys' length along dim -2", read back from the keys when unflattened;
    - any other (past the window; a ``StaticSlidingWindowLayer``'s ``cumulative_length_int``, its keys keeping the
      window's size) as a leaf of its own, a :class:`Length`: an input like a tensor's size, which an export keeps
      symbolic where it makes sizes symbolic (:mod:`autofuse.sizes`).

    Off for a model that is an exported program's module: its forward checks the structure it was exported with,
    in which the number stands. Outside this block flattening is transformers' own, so a ``torch.export`` of the
    user's elsewhere in the process gives the structure it gave."""
    return _setting(_TIED, not program_module(model))


def tied_as(on: bool):
    """Flattening as it was when a structure was captured (``Captured.tied``)."""
    return _setting(_TIED, on)


def plain_lengths():
    """While torch.export flattens the inputs it is handed: a lifted length is a plain int leaf (torch makes its
    symbols from ints only), not a :class:`Length`. The structure is the same."""
    return _setting(_PLAIN, True)


class Length(int):
    """A sliding-window layer's length that is not its keys' length, lifted out of the cache's structure into a
    leaf of its own (:func:`lengths_tied`). The cache object unflattened from it holds a plain int, as eager's."""
    __slots__ = ()


def _length_attributes() -> dict:
    """The sliding-window layer classes and the attribute holding each one's length as a Python int."""
    try:
        from transformers.cache_utils import DynamicSlidingWindowLayer, StaticSlidingWindowLayer
    except Exception:  # noqa: BLE001 - an older transformers: no such layers
        return {}
    return {DynamicSlidingWindowLayer: "cumulative_length", StaticSlidingWindowLayer: "cumulative_length_int"}


def _sliding_layers(obj, kinds, seen=None):
    """``(layer, attribute)`` for each sliding-window layer inside a cache object (its layers, an
    encoder-decoder cache's two caches' layers), in the order transformers' flatten meets them."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _sliding_layers(v, kinds, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _sliding_layers(v, kinds, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.Tensor, type)):
        attr = next((a for k, a in kinds.items() if isinstance(obj, k)), None)
        if attr is not None:
            yield obj, attr
        for v in vars(obj).values():
            yield from _sliding_layers(v, kinds, seen)


def _same_size(n, length) -> bool:
    """Whether a layer's length ``n`` is its keys' ``length``: equal ints, or the same symbolic size."""
    if type(n) is int and type(length) is int:
        return n == length
    return isinstance(n, torch.SymInt) and isinstance(length, torch.SymInt) and n.node.expr == length.node.expr


def _marked(ctx, leaves, lengths):
    """``ctx`` with each layer's placeholder string (``_PLACE`` + k) replaced by its length's mark: the keys' size
    where ``lengths[k]`` is tied, else a leaf appended to ``leaves`` (transformers' own mark for a leaf)."""
    if isinstance(ctx, list):
        return [_marked(c, leaves, lengths) for c in ctx]
    if not isinstance(ctx, dict):
        return ctx
    out = {k: _marked(v, leaves, lengths) for k, v in ctx.items()}
    for k, v in ctx.items():
        if isinstance(v, str) and v.startswith(_PLACE):
            value, tied = lengths[int(v[len(_PLACE):])]
            if tied:
                out[k] = {"_t": _LENGTH, "i": ctx["keys"]["i"], "d": -2}
            else:
                out[k] = {"_t": "sym", "i": len(leaves)}
                leaves.append(Length(value) if type(value) is int and not _PLAIN.get() else value)
    return out


def _untie(ctx, values: list):
    """``ctx`` with each keys' size mark replaced by transformers' mark for a leaf, the size appended to
    ``values``."""
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
    """A pytree node definition of transformers' ``base`` whose flatten writes sliding-window layers' lengths as
    sizes inside :func:`lengths_tied`, and whose unflatten reads them wherever they are so written.

    transformers' flatten writes every plain value of the object into the structure, and cannot write what
    torch.export hands back while it traces (an int leaf comes back wrapped, in ``_IntWrapper``). So each layer's
    length is set aside first: the attribute reads a placeholder string while transformers flattens, and is put
    back before this returns (the object is the caller's, as it was)."""
    def flatten(obj):
        if not _TIED.get():             # transformers' own flatten: no walk over the cache's objects
            return base.flatten_fn(obj)
        layers = [(layer, attr) for layer, attr in _sliding_layers(obj, _length_attributes())
                  if isinstance(layer.__dict__.get("keys"), torch.Tensor) and attr in layer.__dict__]
        if not layers:
            return base.flatten_fn(obj)
        lengths = []
        for k, (layer, attr) in enumerate(layers):
            n = layer.__dict__[attr]
            lengths.append((n, attr == "cumulative_length" and _same_size(n, layer.keys.shape[-2])))
            layer.__dict__[attr] = f"{_PLACE}{k}"
        try:
            leaves, ctx = base.flatten_fn(obj)
        finally:
            for (layer, attr), (n, _) in zip(layers, lengths):
                layer.__dict__[attr] = n
        return leaves, _marked(ctx, leaves, lengths)

    def flatten_with_keys(obj):
        leaves, ctx = flatten(obj)
        return [(pytree.SequenceKey(i), leaf) for i, leaf in enumerate(leaves)], ctx

    def unflatten(values, ctx):
        values = [int(v) if type(v) is Length else v for v in values]     # the object holds a plain int, as eager's
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


__all__ = ["adopt", "caches_in", "has_windowed_layers", "is_cache", "lengths_tied", "prepare", "tied_as", "Length"]
