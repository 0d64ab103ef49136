"""The engine: capture → canonicalize → match → plan (price, choose, verify) → rewrite.

    fused = AutoFusionEngine.fuse(model, example_inputs, target_device="ascend910", optimization_level="O3",
                                  memory_budget="16GB")
    y = fused(*inputs)              # fused blocks run on the NPU simulator, the rest as captured, in torch
    print(fused.report.summary())   # what was fused, what was not and why, with the numbers
    fused.simulate(*inputs)         # the whole graph on the simulator: cycles per node, peak memory

**The fused model is the user's model.** What runs is the captured graph with each applied fusion's nodes
replaced by its fused call; every other node is the captured node, unchanged (the canonical form serves
matching only), so at O0 the output is bit-identical to the captured graph's. Parameters and buffers are
read from the user's model at every call (``model.get_parameter`` by name: in-place edits,
``load_state_dict``, reassigned buffers, ``.to()``/``.half()`` are all seen) and get their gradients. A
plan is kept per *key*: the input signature (shapes, dtypes, non-tensor arguments), the training flags
of the model's modules and the autocast state; ``model.train()``/``.eval()`` after ``fuse()`` switch to that
mode's plan (in training mode every dropout draws eager's keep-mask, fused or not). A plan is valid while its
*guards* hold: the dtype, shape and device of every parameter and buffer the graph reads, the identity,
version counter and values of any buffer whose value the plan relied on (a mask proven causal or empty), and
the identity of every module with its forward hooks, its forward and the value of its plain attributes (a
dropout's ``p``, a norm's ``eps``: capture bakes them in as constants). A failed guard re-plans;
the new report says which guard fired (``report.replanned_because``).

Without example inputs the engine plans at the first call, and again for each new key. The user's model is
never modified by ``fuse``: the fused module holds it as its submodule ``model`` (so ``parameters()``,
``state_dict()``, ``train()``, ``.to()`` reach the shared tensors; ``state_dict()`` keys are the model's own).

Models and inputs must be float16, bfloat16 or float32 (integer inputs such as token ids are fine): the NPU
has no float64 unit, and ``fuse`` says so naming the tensor. A float64 input the model casts into its dtype before
any op computes with it (a vision model's ``pixel_values.to(self.projection.weight.dtype)``) is accepted: the check
runs on the captured graph, and a refusal names the first op that reads the input in float64.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import decimal
import fractions
import functools
import inspect
import operator
import threading
import time
import warnings

import torch
import torch.autograd.forward_ad as fwAD
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from autofuse import caches, checkpointing, memory
from autofuse import verify as _verify
from autofuse.agreement import Agreement, collective_group
from autofuse.canonicalize import LARGEST_CONSTANT, canonicalize, evaluate_constant
from autofuse.capture import capture, holds_tensor, same_value, state_tensor
from autofuse.decision import FusionReport
from autofuse.fused import family_of, is_fused_call
from autofuse.graph import NodeValues as _Values
from autofuse.grad_ops import CUSTOM_FUNCTION, CUSTOM_FUNCTIONS, PASS_GRADIENT, USER_FUNCTION_OP, USER_FUNCTIONS
from autofuse.graph import (checkpoint_of, copy_graph_module, describe_node, floating, get_attr_value,
                            keeps_checkpoints, realised, returned)
from autofuse.hierarchy import lead_match
from autofuse.match import families
from autofuse.plan import GENERIC, baselines, parse_level, parse_memory_budget, plan, returned_and_read
from autofuse.rewrite import _source as source
from autofuse.rewrite import fused_block, rewrite
from autofuse.sizes import SizeFamilies, layout
from cost_model.devices import get_device


def _is_meta(leaves) -> bool:
    return any(isinstance(x, torch.Tensor) and x.device.type == "meta" for x in leaves)


def autocast_state() -> tuple:
    """The autocast regions the call runs in (device type, dtype): capture traces the forward under them, so the
    graph's casts are theirs and a plan holds for one state only."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))


@contextlib.contextmanager
def _autocast_off():
    """Autocast off while a plan's graph runs: the graph was captured under the call's autocast state (part of the
    plan's key), so its casts are already the ones autocast made, and an op the forward ran with autocast disabled
    (``with torch.autocast("cpu", enabled=False)``, as RoPE tables and fp32 norms are computed) is an fp32 op in
    it, which the caller's autocast would cast down again."""
    on = [d for d, _ in autocast_state()]
    with contextlib.ExitStack() as stack:
        for d in on:
            stack.enter_context(torch.autocast(d, enabled=False))
        yield


def _program_input_name(path) -> str:
    """An exported program's input by its pytree path in ``(args, kwargs)``: ``keyword input 'bias'``,
    ``positional input 0['ids']``."""
    head, rest = path[1], pytree.keystr(path[2:])
    if getattr(path[0], "idx", None) == 0:
        return f"positional input {getattr(head, 'idx', head)}{rest}"
    return f"keyword input {getattr(head, 'key', head)!r}{rest}"


def _signature(args, kwargs):
    leaves, spec = pytree.tree_flatten((args, kwargs))
    sig = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            sig.append(("T", tuple(x.shape), x.dtype, x.device.type, layout(x)))
        else:
            if isinstance(x, float):
                # by its bits: -0.0 equals 0.0 but a forward may tell them apart (x / s, copysign), and a NaN
                # equals no NaN, so a call with a new NaN object missed every plan
                sig.append(("V", type(x), x.hex()))
                continue
            try:
                hash(x)
                sig.append(("V", type(x), x))       # 2 and 2.0 are equal, but a forward may tell them apart
            except TypeError:
                sig.append(("V", repr(x)))
    return (spec, tuple(sig))


def _capture_changes(a, b) -> dict | None:
    """How capture ``b`` differs from capture ``a`` of one model: None where their structures, graphs or what the
    call leaves behind (the state and inputs it updates, the plain attributes it sets and their values) differ,
    else the positions among the graph's outputs whose numbers differ, with ``b``'s numbers (a KV cache's new
    length, returned as a number: :meth:`Plan.with_outputs`)."""
    same = (a.route, a.in_spec, a.out_spec, a.training, a.state_updates, a.input_updates) == \
        (b.route, b.in_spec, b.out_spec, b.training, b.state_updates, b.input_updates) and \
        len(a.attribute_updates) == len(b.attribute_updates) and \
        all(m is n and k == j and same_value(v, w)
            for (m, k, v), (n, j, w) in zip(a.attribute_updates, b.attribute_updates))
    return graph_changes(a.graph_module, b.graph_module) if same else None


def graph_changes(a: fx.GraphModule, b: fx.GraphModule) -> dict | None:
    """Whether two captured graphs compute the same thing on the same inputs, but for numbers they return: None
    unless they have the same nodes (op, target, name) with the same arguments, every constant they read the same
    (a parameter the same object, a constant tensor equal in dtype, shape, strides and values, a nested graph the
    same graph), every input read alike or read by no node, and the same capture metadata; else ``{position: b's
    number}`` for the outputs that are numbers (ints, floats, bools) differing between the two. Node metadata is not
    compared: it follows from the inputs and the nodes."""
    na, nb = list(a.graph.nodes), list(b.graph.nodes)
    if len(na) != len(nb) or not same_value(a.meta, b.meta):
        return None
    changes: dict = {}
    for x, y in zip(na, nb):
        if (x.op, x.target, x.name) != (y.op, y.target, y.name):
            return None
        if x.op == "placeholder":
            if (x.users or y.users) and not _same_constant(x.meta.get("val"), y.meta.get("val")):
                return None
            continue
        if x.op == "get_attr":
            if not _same_constant(get_attr_value(a, x.target), get_attr_value(b, y.target)):
                return None
            continue
        if x.op == "output" and not x.kwargs and not y.kwargs and isinstance(x.args[0], (tuple, list)) and \
                isinstance(y.args[0], (tuple, list)) and len(x.args[0]) == len(y.args[0]):
            for i, (u, v) in enumerate(zip(fx.map_arg(x.args[0], _named), fx.map_arg(y.args[0], _named))):
                if same_value(u, v):
                    continue
                if not (type(u) is type(v) and type(u) in (int, float, bool)):
                    return None
                changes[i] = v
        elif not same_value(fx.map_arg((x.args, x.kwargs), _named), fx.map_arg((y.args, y.kwargs), _named)):
            return None
    return changes


def _named(node: fx.Node):
    """A node argument as :func:`graph_changes` compares it: by its name."""
    return ("node", node.name)


def _same_constant(x, y) -> bool:
    """A graph's constant or input value: tensors the same object or equal in metadata and values (metadata alone
    for values without data, an input's fake tensor), nested graphs the same graph (numbers returned included),
    anything else same_value."""
    if x is y:
        return True
    if isinstance(x, fx.GraphModule) and isinstance(y, fx.GraphModule):
        return graph_changes(x, y) == {}
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        return same_value(x, y)
    meta = (x.dtype, x.shape, x.stride(), x.storage_offset(), x.device, x.requires_grad)
    if meta != (y.dtype, y.shape, y.stride(), y.storage_offset(), y.device, y.requires_grad):
        return False
    from torch._subclasses.fake_tensor import FakeTensor
    if x.is_meta or isinstance(x, FakeTensor) or y.is_meta or isinstance(y, FakeTensor):
        return True
    return _same_values(x.detach(), y.detach())


def _without_lengths(key):
    """A plan's key with the values of its lifted KV cache lengths left out (:meth:`FusedModule._twins`)."""
    (spec, sig), rest = key[0], key[1:]
    return ((spec, tuple(e[:2] if len(e) == 3 and e[1] is caches.Length else e for e in sig)),) + tuple(rest)


def all_candidates(gm: fx.GraphModule) -> list:
    """Every match of every family, overlaps included: choosing among them is the planner's job. A Vector region
    that overlaps a pattern's block is also offered without the block's nodes (``outside_blocks`` of
    :mod:`patterns.vector_chain`), so the rest of it still fuses where the block wins."""
    out = []
    for find in families().values():
        out.extend(find(gm))
    blocks = [m for m in out if family_of(m).name not in GENERIC]
    if not blocks:
        return out
    from patterns.vector_chain import outside_blocks    # imported by families() above
    return out + outside_blocks(gm, blocks)


# ------------------------------------------------------------------------------------ state and guards

def _state_nodes(gm: fx.GraphModule) -> dict:
    return {n.target: n.meta["autofuse_state"] for n in gm.graph.nodes
            if n.op == "get_attr" and "autofuse_state" in n.meta}


def _live_getattr(self, name):
    try:
        return torch.nn.Module.__getattr__(self, name)
    except AttributeError:
        model = self.__dict__.get("_autofuse_model")
        if model is None:
            raise
        return getattr(model, name)


def _make_live(gm: fx.GraphModule, model: torch.nn.Module) -> fx.GraphModule:
    """Make ``gm``'s parameter and buffer reads go to ``model`` at every call: the copies of the model's
    tensors that building a GraphModule makes are dropped, and attribute lookups the graph does not
    own fall through to the model (``self.layer.weight`` is ``model.layer.weight``, as it is now)."""
    for target in _state_nodes(gm):
        top = target.split(".")[0]
        for store in (gm._modules, gm._parameters, gm._buffers):
            store.pop(top, None)
    gm.__dict__["_autofuse_model"] = model
    type(gm).__getattr__ = _live_getattr       # fx gives every GraphModule its own class
    return gm


class Guard:
    """What a plan assumed about one of the model's tensors; ``check(model)`` says what changed, or None."""

    def __init__(self, fqn: str, tensor: torch.Tensor, value: bool):
        self.fqn, self.value = fqn, value
        self.tensor = tensor if value else None
        self.version = tensor._version if value else None
        self.spec = (tensor.dtype, tuple(tensor.shape), tensor.device.type)
        # the values themselves: an update through ``.data`` (``t.data.copy_(...)``, ``t.data = other``) moves
        # neither the tensor's identity nor its version counter
        self.copy = tensor.detach().clone() if value and tensor.device.type != "meta" else None
        self.requires_grad = tensor.requires_grad if value else None

    def check(self, model) -> str | None:
        try:
            t = state_tensor(model, self.fqn)
        except AttributeError:
            return f"{self.fqn} is gone from the model"
        if not isinstance(t, torch.Tensor):
            return f"{self.fqn} is now {t!r}, no tensor (the plan read it as one)"
        spec = (t.dtype, tuple(t.shape), t.device.type)
        if spec != self.spec:
            return f"{self.fqn} changed from {self._fmt(self.spec)} to {self._fmt(spec)}"
        if self.value and t is not self.tensor:
            return f"{self.fqn} was replaced by another tensor (the plan relied on its value)"
        if self.value and t._version != self.version:
            return f"{self.fqn} was modified in place (the plan relied on its value)"
        if self.copy is not None and not _same_values(t.detach(), self.copy):
            return f"{self.fqn} holds other values (changed through .data; the plan relied on its value)"
        if self.value and t.requires_grad != self.requires_grad:
            # a value proven constant (a zero bias left out of a fused call) gets no gradient: unfrozen, it must
            return f"{self.fqn} now {'requires' if t.requires_grad else 'no longer requires'} grad (the plan " \
                   f"relied on its value)"
        return None

    @staticmethod
    def _fmt(spec):
        dt, shape, dev = spec
        return f"{str(dt).replace('torch.', '')}{list(shape)} on {dev}"

    def describe(self) -> str:
        what = "identity, version and values" if self.value else "dtype, shape and device"
        return f"{self.fqn}: {what}"


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element by element, a NaN equal to a NaN (a float buffer holding NaN is not a changed one)."""
    if floating(a):
        return torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True)
    return torch.equal(a, b)


_MISSING = object()


class _TensorState:
    """A plain tensor attribute (not a parameter or buffer: those have guards of their own) as a plan saw it: the
    tensor itself (held, so that its identity cannot pass to another), its version, and up to
    :data:`_VALUES_KEPT` elements its values (an edit through ``.data`` moves neither identity nor version)."""

    def __init__(self, t: torch.Tensor, budget=None):
        self.tensor, self.version = t, t._version
        self.copy = t.detach().clone() if _within(t.numel(), budget) and t.device.type != "meta" else None

    def holds(self, t) -> bool:
        """Whether ``t`` is that tensor, at that version, with those values."""
        return t is self.tensor and t._version == self.version and \
            (self.copy is None or _same_values(t.detach(), self.copy))


#: The largest plain tensor attribute whose values a plan keeps to compare (4 Mi elements); a larger one is
#: guarded by identity and version only. Numpy arrays likewise (by identity only beyond it), and the tensors and
#: arrays of one container (:class:`_Tree`) up to this many elements in all.
_VALUES_KEPT = 1 << 22


def _within(numel: int, budget) -> bool:
    """Whether values of ``numel`` elements are kept: up to :data:`_VALUES_KEPT`, or, for the tensors and arrays of
    one container, while its ``budget`` (a one-element list: the elements left) lasts, which they then use."""
    if budget is None:
        return numel <= _VALUES_KEPT
    if numel > budget[0]:
        return False
    budget[0] -= numel
    return True


try:
    import numpy as _np
except ImportError:             # numpy is optional for torch
    _np = None


def _is_array(v) -> bool:
    return _np is not None and isinstance(v, _np.ndarray)


class _ArrayState:
    """A numpy array attribute as a plan saw it (``torch.from_numpy(self.table)`` is captured as a constant): its
    dtype, shape and values up to :data:`_VALUES_KEPT` elements, beyond that (or holding Python objects) the array
    itself by identity (numpy keeps no version counter)."""

    def __init__(self, a, budget=None):
        self.array = a
        self.copy = a.copy() if not a.dtype.hasobject and _within(a.size, budget) else None

    def holds(self, a) -> bool:
        if a is self.array and self.copy is None:
            return True
        if self.copy is None or type(a) is not type(self.array) or a.dtype != self.copy.dtype or \
                a.shape != self.copy.shape:
            return False
        return bool(_np.array_equal(a, self.copy, equal_nan=a.dtype.kind in "fc"))


class _Same:
    """A value guarded by identity: a function kept as an attribute (``self.act = F.gelu``), an object whose fields
    are guarded by :class:`_Fields`, a container too large to compare at each call."""

    def __init__(self, v):
        self.v = v


#: What every ``nn.Module`` keeps in its ``__dict__`` for itself (parameters, buffers, submodules, hook
#: dictionaries) and its mode: not attributes a forward reads as values (hooks have a guard of their own).
_MODULE_OWN = frozenset(vars(torch.nn.Module())) | {"forward"}


#: The most values a kept container holds to be compared by value at each call (a vocabulary held as a dict is
#: compared by identity instead: a forward bakes in small tables, and comparing a large one costs each call).
_VALUES_COMPARED = 4096


def _fewer_values(v, most: int) -> bool:
    """Whether the container ``v`` holds at most ``most`` values, nested ones counted."""
    stack, seen = [v], 0
    while stack:
        x = stack.pop()
        items = x.values() if isinstance(x, dict) else x if isinstance(x, (tuple, list, set, frozenset)) else None
        if items is None:
            seen += 1
        else:
            seen += len(items) if isinstance(x, dict) else 0
            stack.extend(items)
        if seen > most:
            return False
    return True


#: Values that compare by value: numbers (a ``Fraction``, a ``Decimal`` too), strings, bytes, flags, None, dtypes,
#: devices, shapes and ranges; numpy scalars and slices of such values are plain too (:func:`_plain_value`).
_SCALARS = (bool, int, float, complex, str, bytes, bytearray, type(None), torch.dtype, torch.device, torch.Size,
            range, fractions.Fraction, decimal.Decimal)


def _plain_value(v) -> bool:
    """A number (a numpy scalar, a ``Fraction`` too), string, bytes, flag, None, dtype, device, shape, range or
    slice, or a tuple, list, set or dict (string keys) of such values at any depth: what capture bakes in as a
    constant, kept by a deep copy and compared by value."""
    if isinstance(v, _SCALARS) or _np is not None and isinstance(v, _np.generic):
        return True
    if isinstance(v, slice):
        return _plain_value(v.start) and _plain_value(v.stop) and _plain_value(v.step)
    if isinstance(v, (tuple, list, set, frozenset)):
        return all(_plain_value(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _plain_value(x) for k, x in v.items())
    return False


_CONTAINERS = (tuple, list, set, frozenset, dict)


def _value(v) -> bool:
    """A plain value (:func:`_plain_value`), or a container too large to compare at each call (by identity)."""
    if isinstance(v, _CONTAINERS) and not _fewer_values(v, _VALUES_COMPARED):
        return True
    return _plain_value(v)


def _guardable(v) -> bool:
    """A value a forward may read from a module attribute and capture bake in: a plain value (:func:`_value`),
    a tensor, a numpy array, a tuple, list or dict holding tensors or arrays among plain values (:func:`_tree`), a
    function, or an object whose public plain fields it may read (:func:`_held_object`)."""
    return _value(v) or isinstance(v, torch.Tensor) or _is_array(v) or _tree(v) or \
        callable(v) and not isinstance(v, torch.nn.Module) or _held_object(v)


def _tree(v) -> bool:
    """A tuple, list or dict (string or int keys) whose values at any depth are plain values (:func:`_plain_value`),
    tensors or numpy arrays, at least one of them a tensor or an array (RoPE tables kept as
    ``{"cos": ..., "sin": ...}``): guarded as :class:`_Tree`."""
    found, stack = False, [v]
    while stack:
        x = stack.pop()
        if isinstance(x, (tuple, list)):
            stack.extend(x)
        elif isinstance(x, dict):
            if not all(isinstance(k, (str, int)) for k in x):
                return False
            stack.extend(x.values())
        elif isinstance(x, torch.Tensor) or _is_array(x):
            found = True
        elif not _plain_value(x):
            return False
    return found and isinstance(v, (tuple, list, dict))


class _Tree:
    """A container of tensors or arrays (:func:`_tree`) as a plan saw it: its type and length or keys at every
    depth, each tensor as a non-buffer tensor attribute is kept (:class:`_TensorState`: identity, version, and
    values while the container's tensors and arrays hold up to :data:`_VALUES_KEPT` elements in all), each array
    as :class:`_ArrayState`, each other value by value."""

    def __init__(self, v, budget=None):
        budget = [_VALUES_KEPT] if budget is None else budget
        self.type = type(v)
        self.keys = tuple(v) if isinstance(v, dict) else len(v)
        self.items = tuple(_kept(x, budget) for x in (v.values() if isinstance(v, dict) else v))

    def changed(self, cur) -> str | None:
        if type(cur) is not self.type:
            return f"was replaced by a {type(cur).__name__} (the plan captured a {self.type.__name__} of tensors)"
        if isinstance(cur, dict):
            if tuple(cur) != self.keys:
                return f"has the keys {list(cur)} (the plan captured {list(self.keys)})"
            names, items = self.keys, cur.values()
        else:
            if len(cur) != self.keys:
                return f"holds {len(cur)} values (the plan captured {self.keys})"
            names, items = range(self.keys), cur
        for k, kept, x in zip(names, self.items, items):
            why = _changed(kept, x)
            if why is not None:
                return f"[{k!r}] {why}"
        return None


def _same_plain(a, b) -> bool:
    """Two plain values (:func:`_plain_value`) are the same: of one type and equal, NaN equal to NaN, a range or a
    slice by its start, stop and step, containers element by element."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same_plain, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_plain(a[k], b[k]) for k in a)
    if isinstance(a, (range, slice)):
        return all(map(_same_plain, (a.start, a.stop, a.step), (b.start, b.stop, b.step)))
    if _np is not None and isinstance(a, _np.generic):
        if bool(a != a):
            return bool(b != b)
        return bool(a == b) and (not isinstance(a, _np.floating) or bool(_np.signbit(a) == _np.signbit(b)))
    return same_value(a, b)


def _changed(kept, cur) -> str | None:
    """How ``cur`` differs from what :func:`_kept` kept (a tensor: its identity, version and values; an array: its
    values; a container of tensors: its structure and each element; an object by identity; a value by value), in
    words after the attribute's name; None where it does not."""
    if isinstance(kept, _TensorState):
        return None if kept.holds(cur) else "was replaced or modified in place (captured as a constant)"
    if isinstance(kept, _ArrayState):
        return None if kept.holds(cur) else "was replaced or modified in place (a numpy array captured as a constant)"
    if isinstance(kept, _Tree):
        return kept.changed(cur)
    if isinstance(kept, _Same):
        return None if cur is kept.v else f"was replaced by {cur!r} (the plan captured {kept.v!r})"
    return None if _same_plain(cur, kept) else f"changed from {kept!r} to {cur!r} (captured as a constant)"


def _of(where: str, why: str) -> str:
    """``why`` (:func:`_changed`) said of the attribute ``where``: an element's change (``['cos'] ...``) follows the
    name directly."""
    return f"{where}{why}" if why.startswith("[") else f"{where} {why}"


def _held_object(v) -> bool:
    """An object a module holds whose public fields a forward may read (a model's ``config``, a namespace of
    options): guarded by identity and by those fields' values (:class:`_Fields`)."""
    return hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, torch.Tensor, type)) and not callable(v)


class _Fields:
    """The public fields of a held object (:func:`_held_object`) that are values (:func:`_value`: no tensor,
    function or object), as a plan saw them: a forward that reads ``self.config.use_cache`` baked it in."""

    def __init__(self, obj):
        self.obj = obj
        self.fields = {k: _kept(v) for k, v in _public_values(obj)}

    def check(self) -> str | None:
        now = vars(self.obj)
        for k, v in self.fields.items():
            cur = now.get(k, _MISSING)
            if cur is v:            # the very value kept: an immutable one (what changes in place is kept as a copy)
                continue
            if cur is _MISSING:
                return f"{k} is gone from {type(self.obj).__name__}"
            why = _changed(v, cur)
            if why is not None:
                return f"{type(self.obj).__name__}.{k} {why}"
        return None


def _public_values(obj):
    return [(k, v) for k, v in vars(obj).items() if not k.startswith("_") and _value(v)]


def _kept(v, budget=None):
    """What a plan keeps of a guarded attribute's value (:func:`_guardable`): containers of plain values
    deep-copied (edited in place, at any depth), a tensor as a :class:`_TensorState`, a numpy array as an
    :class:`_ArrayState`, a container holding tensors or arrays as a :class:`_Tree`, a function, a held object or
    a container too large to compare by identity (:class:`_Same`), anything else as it is. ``budget``: the
    elements a container's tensors and arrays may still keep values of (:func:`_within`)."""
    if isinstance(v, torch.Tensor):
        return _TensorState(v, budget)
    if _is_array(v):
        return _ArrayState(v, budget)
    if isinstance(v, _CONTAINERS):          # a large container by identity
        if not _fewer_values(v, _VALUES_COMPARED):
            return _Same(v)
        return _Tree(v, budget) if _tree(v) else copy.deepcopy(v)
    if isinstance(v, bytearray):
        return bytearray(v)
    if callable(v) and not isinstance(v, type) or _held_object(v):
        return _Same(v)
    return v


def state_spec(model) -> tuple:
    """dtype, shape and device of every parameter and buffer: a symbolic export holds them (part of its family's
    key, :mod:`autofuse.sizes`; a plan's own :class:`Guard` checks those its graph reads)."""
    return tuple((t.dtype, tuple(t.shape), t.device.type) for t in (*model.parameters(), *model.buffers()))


#: A module's hook dictionaries (forward and backward, hooks and pre-hooks): capture runs the forward ones.
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")


def _global_hooks() -> tuple:
    """torch's global module hooks (``register_module_forward_hook`` and friends), by identity: capture runs them
    into the graph like a module's own. Each is kept with its handle's id (never reused) and the hook itself (held,
    so that its address cannot pass to another): a tuple of them compares equal only to the same hooks."""
    from torch.nn.modules import module as _m
    return tuple(tuple(getattr(_m, d, {}).items())
                 for d in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_hooks",
                           "_global_backward_pre_hooks"))


class TiedGuard:
    """Names that held one tensor when the plan was made (tied embedding and output weights): the graph reads it
    under one of them, so untying them (``head.weight = nn.Parameter(...)``) must plan again."""

    value = False

    def __init__(self, names: tuple):
        self.names = names

    def check(self, model) -> str | None:
        try:
            first = state_tensor(model, self.names[0])
            for name in self.names[1:]:
                if state_tensor(model, name) is not first:
                    return f"{name} no longer is {self.names[0]} (they were tied when the plan was made)"
        except AttributeError:
            return f"one of {', '.join(self.names)} is gone from the model"
        return None

    def describe(self) -> str:
        return f"{' = '.join(self.names)}: tied"


def tied_guards(model, read) -> list:
    """A :class:`TiedGuard` for each tensor the graph reads (``read``: names) that the model holds under several
    names."""
    names: dict = {}
    for fqn, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), []).append(fqn)
    return [TiedGuard(tuple(group)) for group in names.values() if len(group) > 1 and set(group) & set(read)]


class ModuleGuard:
    """What a plan assumed about the model's modules: which module sits at each name, the value of every
    attribute of each that a forward may read as a value (:func:`_guardable`: numbers, strings, flags, dtypes,
    containers of them at any depth: a dropout's ``p``, a norm's ``eps``, an attention's ``scaling``, private ones
    such as ``_scale`` too; functions kept as attributes, by identity; tensors that are no parameter or buffer,
    by identity, version and values), the set of each module's attribute names (one added later may be one the
    forward looked for) and of its parameter, buffer and submodule slots with which of them hold None (a
    ``bias=False`` given a parameter later, a buffer registered as None and assigned), the module's hooks, forward and class, and torch's global module hooks. Capture bakes such
    values into the graph as constants, so a changed one (or a module swapped for another) re-plans rather than
    run the old value. ``training`` is part of the plan's key instead. A forward that settles an attribute itself
    leaves it changed after its first call, so the next call plans again from the settled value; one that changes
    it at every call is refused at capture (:func:`autofuse.capture.capture`). An object a module holds (a
    config) is guarded by identity and by its public plain fields (:class:`_Fields`), not deeper."""

    value = False

    def __init__(self, model: torch.nn.Module):
        self.modules = dict(model.named_modules())
        # every name a module is reached by: one registered under two names (act1 = act2) may be re-pointed at one
        self.every_name = dict(model.named_modules(remove_duplicate=False))
        # the parameter, buffer and submodule slots of each module, and which hold None (a bias=False filled
        # later, an optional buffer registered as None and assigned, a parameter or buffer registered since)
        self.slots = {name: _slots(m) for name, m in self.modules.items()}
        self.attrs = [(name, k, _kept(v)) for name, m in self.modules.items() for k, v in vars(m).items()
                      if k not in _MODULE_OWN and _guardable(v)]
        # an attribute added later may be one the forward looked for (getattr(self, "scale", 1.0))
        self.names = {name: frozenset(vars(m)) for name, m in self.modules.items()}
        self.objects = {id(v.v): _Fields(v.v) for _, _, v in self.attrs if isinstance(v, _Same) and _held_object(v.v)}
        self.calls = {name: _call_state(m) for name, m in self.modules.items()}
        self.hooks = _global_hooks()
        self.classes = [_ClassState(c) for c in _module_classes(self.modules.values())]

    def check(self, model) -> str | None:
        now = dict(model.named_modules(remove_duplicate=False))
        for name, m in self.every_name.items():
            if now.get(name) is not m:
                return f"module {name or '(the model)'} was replaced or removed (the plan captured the old one)"
        for name, m in self.modules.items():
            if _call_state(m) != self.calls[name]:
                return (f"module {name or '(the model)'} has other forward hooks or another forward (or class) than "
                        f"when it was captured (capture runs them into the graph)")
        if _global_hooks() != self.hooks:
            return "torch's global module hooks changed since capture (capture runs them into the graph)"
        for cls in self.classes:
            why = cls.check()
            if why is not None:
                return why
        for name, k, v in self.attrs:
            cur = vars(self.modules[name]).get(k, _MISSING)
            if cur is v:            # the very value kept: an immutable one (what changes in place is kept as a copy)
                continue
            where = f"{name + '.' if name else ''}{k}"
            if cur is _MISSING:
                return f"{where} is gone from the model"
            why = _changed(v, cur)
            if why is not None:
                return _of(where, why)
        for fields in self.objects.values():
            why = fields.check()
            if why is not None:
                return why
        for name, m in self.modules.items():
            why = _slots_changed(self.slots[name], _slots(m), name)
            if why is not None:
                return why
        for name, m in self.modules.items():
            added = sorted(set(vars(m)) - self.names[name])
            if added:
                return f"{name + '.' if name else ''}{added[0]} was added to the model since the plan was made (a " \
                       f"forward may read it)"
        return None

    def describe(self) -> str:
        return (f"{len(self.modules)} modules and {len(self.attrs)} attributes: identity, hooks and forward, "
                f"attribute names, and value")


def _module_classes(modules) -> list:
    """The classes of ``modules`` and their bases, nn.Module and its own bases left out, each once."""
    skip = set(torch.nn.Module.__mro__)
    return list(dict.fromkeys(c for m in modules for c in type(m).__mro__ if c not in skip))


def _dunder(k) -> bool:
    return isinstance(k, str) and k.startswith("__") and k.endswith("__")


class _ClassState:
    """A module class's own attributes as a plan saw them (``scale = 1.0`` in the class body, a helper method a
    forward calls, a class-wide table): capture bakes them in as it does an instance's. The class's ``__dict__`` is
    kept as it was (values held) and compared at each call in one step, each entry by identity or equality (a
    function by identity, a plain value by value); a container, tensor or array among them is kept as an instance
    attribute's is (:func:`_kept`), so an edit in place is seen too. Names torch and Python keep there themselves
    (``__doc__``, ``__annotations__``) are not guarded."""

    def __init__(self, cls):
        self.cls = cls
        self.snapshot = dict(vars(cls))
        self.kept = [(k, kept) for k, v in self.snapshot.items() if not _dunder(k) and _mutable(v) and _guardable(v)
                     for kept in (_kept(v),) if not isinstance(kept, _Same)]

    def check(self) -> str | None:
        now = vars(self.cls)
        try:
            same = now == self.snapshot
        except Exception:  # noqa: BLE001 - a value without a plain equality (an array put in its place)
            same = False
        if not same:
            why = self._differs(now)
            if why is not None:
                return why
            self.snapshot = dict(now)           # only names Python keeps changed, or a value for an equal one
        for k, kept in self.kept:
            cur = now.get(k, _MISSING)
            why = "is gone from the class" if cur is _MISSING else _changed(kept, cur)
            if why is not None:
                return _of(f"{self.cls.__qualname__}.{k}", why)
        return None

    def _differs(self, now) -> str | None:
        name = self.cls.__qualname__
        for k in dict.fromkeys((*self.snapshot, *now)):
            was, cur = self.snapshot.get(k, _MISSING), now.get(k, _MISSING)
            if was is cur or _dunder(k):
                continue
            if was is _MISSING:
                return f"{name}.{k} was added to the class since the plan was made (a forward may read it)"
            if cur is _MISSING:
                return f"{name}.{k} is gone from the class since the plan was made"
            if _plain_value(was) and _same_plain(cur, was):
                continue
            what = f"changed from {was!r} to {cur!r}" if _plain_value(was) and _plain_value(cur) else "was replaced"
            return f"class attribute {name}.{k} {what} since the plan was made (the plan captured the old one)"
        return None


def _mutable(v) -> bool:
    """A value that can change in place, keeping its identity."""
    return isinstance(v, (list, dict, set, tuple, bytearray, torch.Tensor)) or _is_array(v)


_SLOTS = (("_parameters", "parameter"), ("_buffers", "buffer"), ("_modules", "submodule"))


def _slots(m: torch.nn.Module) -> tuple:
    """The names of ``m``'s parameters, buffers and submodules, each with whether it holds None."""
    return tuple([(k, v is None) for k, v in getattr(m, d).items()] for d, _ in _SLOTS)


def _slots_changed(was: tuple, now: tuple, name: str) -> str | None:
    """How the slots (:func:`_slots`) of the module at ``name`` changed, in words; None where they did not."""
    if was == now:
        return None
    for (_, kind), before, after in zip(_SLOTS, was, now):
        before, after = dict(before), dict(after)
        for k in (*before, *after):
            where = f"{name + '.' if name else ''}{k}"
            if k not in before:
                return f"{where} was added to the model as a {kind} since the plan was made (a forward may read it)"
            if k not in after:
                return f"{where} was removed from the model's {kind}s since the plan was made"
            if before[k] and not after[k]:
                return f"{where} was None when the plan was made and now holds a {kind} (a forward may read it)"
            if after[k] and not before[k]:
                return f"{where} held a {kind} when the plan was made and now is None"
    return f"the {', '.join(kind for _, kind in _SLOTS)} slots of {name or '(the model)'} changed since the plan"


def _said(report, text: str) -> None:
    """A warning both in the report and as a Python warning."""
    report.warnings.append(text)
    warnings.warn("autofuse: " + text, stacklevel=3)


def _returns_through_outputs(hook) -> bool:
    """A hook of transformers' own machinery, whose effect capture keeps: its output recorder
    (``output_hidden_states``, ``output_attentions``; the records are among the model's outputs), which it leaves
    on the modules after such a call, and ``enable_input_require_grads`` (gradient checkpointing), which marks the
    embeddings' output as requiring grad."""
    return (getattr(hook, "__module__", None) or "").startswith("transformers.")


def _hooked_modules(model, kinds=_HOOKS) -> list:
    """Modules with hooks of these kinds (names; "(global)" for torch's global module hooks), transformers' own
    forward hooks left out (:func:`_returns_through_outputs`: capture keeps what they do)."""
    def any_of(hooks):
        return any(d not in _HOOKS[:2] or not _returns_through_outputs(h) for d, h in hooks)
    names = [name or "(the model)" for name, m in model.named_modules()
             if any_of((d, h) for d in kinds for h in getattr(m, d).values())]
    everywhere = dict(zip(_HOOKS, _global_hooks()))       # the same four kinds, in the same order
    return names + (["(global)"] if any_of((d, h) for d in kinds for _, h in everywhere[d]) else [])


def _call_state(m: torch.nn.Module) -> tuple:
    """What a call of ``m`` runs besides its class's forward: its forward and backward hooks and pre-hooks (by
    identity; a new one re-plans, and the report warns of hooks), a forward set on the instance, its class and the
    class's forward."""
    hooks = tuple(tuple(getattr(m, d).items()) for d in _HOOKS)
    # the objects themselves, held (an id alone may pass to a new object once the old one is freed); looked up
    # without descriptors: a TorchScript submodule's class forward is a descriptor that fails on the class
    return hooks, m.__dict__.get("forward"), type(m), inspect.getattr_static(type(m), "forward", None)


class _PlansAndRuns:
    """Plans are made one at a time, process-wide, and never while another thread runs a plan; plans made run
    concurrently with each other.

    torch.export's tracing is not thread-safe (two threads capturing at once failed, and left a traced tensor in the
    user's model), and a non-strict export swaps fake tensors in for the model's own parameters while it traces: a
    plan another thread ran in that window read them, and returned a FakeTensor. So a planner waits for the runs
    of other threads to end, and new runs wait while a plan is made or waits to be made (a planner is not starved).
    A thread that plans inside its own run (a fused module called by code a plan runs) does not wait for the runs
    that wait for it: its run is paused at the call, and other runs paused so do not count either."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._runs: dict = {}           # thread -> how many plan runs it is inside
        self._planner = None            # the thread making a plan
        self._depth = 0                 # how deep that thread is in planning (a plan made inside planning)
        self._waiting: set = set()      # threads waiting to plan

    @contextlib.contextmanager
    def running(self):
        me = threading.get_ident()
        with self._cond:
            # a thread already running or planning goes on (it would wait for itself)
            while me not in self._runs and self._planner != me and (self._planner is not None or self._waiting):
                self._cond.wait()
            self._runs[me] = self._runs.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._runs[me] -= 1
                if not self._runs[me]:
                    del self._runs[me]
                self._cond.notify_all()

    @contextlib.contextmanager
    def planning(self):
        me = threading.get_ident()
        with self._cond:
            self._waiting.add(me)
            try:
                while self._planner not in (None, me) or any(t != me and t not in self._waiting for t in self._runs):
                    self._cond.wait()
            finally:
                self._waiting.discard(me)
            self._planner = me
            self._depth += 1
        try:
            with _saved_tensors_hooks_aside():
                yield
        finally:
            with self._cond:
                self._depth -= 1
                if not self._depth:
                    self._planner = None
                self._cond.notify_all()


_PLANNING = _PlansAndRuns()


@contextlib.contextmanager
def _saved_tensors_hooks_aside():
    """The caller's saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``, ``save_on_cpu``, an eager
    checkpoint around the fused model) set aside while a plan is made: planning runs ops on fake tensors with grad
    (their values' metadata, the blocks' checks), whose saves are not the caller's to pack. Put back as they were."""
    from torch._C import _autograd
    stack = []
    while (top := _autograd._top_saved_tensors_default_hooks(True)) is not None:
        stack.append(top)
        _autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(stack):
            _autograd._push_saved_tensors_default_hooks(pack, unpack)


class Plan:
    """One key's compiled graph, with its report and guards."""

    def __init__(self, captured, graph_module, report, canonical, guards, model=None):
        #: planned without grad, the plan is not for a call autograd may differentiate: canonicalize dropped a detach,
        #: the forward applies a custom autograd.Function (whose backward the graph does not keep),
        #: or a fused call reads a value the model returns (cut only in plans made with grad: plan.returned_and_read),
        #: or the forward updates a parameter that requires grad (read after it through a pass with grad only)
        # (a custom Function planned with grad had its backward checked, and self.autograd keys the plan; a plan
        # without grad through activation checkpoints may fuse across them: a call with grad plans again to keep them)
        self.without_grad_only = bool(canonical.meta.get("autofuse_dropped_detach") or
                                      canonical.meta.get("autofuse_returned_read") or
                                      not canonical.meta.get("autofuse_grad", True) and (
                                          canonical.meta.get("autofuse_custom_functions") or
                                          canonical.meta.get("autofuse_checkpoints") or
                                          canonical.meta.get("autofuse_trained_updates")))
        #: the autograd state (:func:`autograd_state`) of the call planned, where the forward read it (a branch on
        #: ``tensor.requires_grad`` or ``torch.is_grad_enabled()``) or applies a custom autograd.Function: the plan
        #: serves only calls in that state
        self.autograd = None
        self.captured = captured
        self.model = model
        self.graph_module = realised(graph_module)      # run by its forward: no hooks
        self.report = report
        self.canonical = canonical
        self.guards = guards
        #: the plan this one was made from, for a call whose graph is its but for numbers returned (with_outputs)
        self.twin_of = None

    def with_outputs(self, changes: dict, captured) -> "Plan | None":
        """This plan for a call whose capture ``captured`` is this plan's but for numbers the graph returns
        (``changes``: position -> number, :func:`graph_changes`; a static cache's sliding-window layer returns its
        new length so): the same fused graph returning those numbers, the decisions, report and guards shared.
        None where the fused graph does not return this plan's numbers at those positions."""
        flat = self.graph_module.graph.output_node().args[0]
        want = self.captured.graph_module.graph.output_node().args[0]
        if not isinstance(flat, (tuple, list)) or len(flat) != len(want) or \
                any(not same_value(flat[i], want[i]) for i in changes):
            return None
        gm = copy_graph_module(self.graph_module)
        new = gm.graph.output_node()
        new.args = (type(flat)(changes.get(i, a) for i, a in enumerate(new.args[0])),)
        served = copy.copy(self)
        served.graph_module, served.captured, served.twin_of = realised(gm), captured, self
        return served

    def failed_guard(self, model) -> str | None:
        for g in self.guards:
            why = g.check(model)
            if why is not None:
                return why
        return None

    def __call__(self, *args, **kwargs):
        with _PLANNING.running():       # no capture swaps the model's parameters for fake ones meanwhile
            return self._run(args, kwargs)

    def _with_checkpoints(self) -> fx.GraphModule:
        """The plan's graph with its activation checkpoints kept (:func:`autofuse.checkpointing.runner`), made once
        per graph: the graph a call with grad runs."""
        made = self.__dict__.get("_checkpointed")
        if made is None or made[0] is not self.graph_module:
            gm = checkpointing.runner(self.graph_module)
            made = (self.graph_module, self.graph_module if gm is None else realised(_make_live(gm, self.model)))
            self._checkpointed = made
        return made[1]

    def _run(self, args, kwargs):
        leaves = self.captured.flatten_inputs(*args, **kwargs)
        # an input updated outside autograd that required grad at a capture with grad (a leaf): its reads pass their
        # gradient (capture._pass_trained_updates)
        graded = [i for i in self.captured.input_updates if getattr(leaves[i], "requires_grad", False)
                  and not (i in self.captured.passed_inputs and leaves[i].is_leaf)]
        if graded and torch.is_grad_enabled():
            raise RuntimeError(f"autofuse: the forward updates input(s) {graded} (by position among the flattened "
                               f"inputs) in place, and this call's require grad; eager's later reads of them carry "
                               f"their gradient, which the fused graph's new values do not. Pass inputs that do not "
                               f"require grad (x.detach()), or return the new value instead of updating it.")
        if self.captured.input_updates and _aliased(leaves, self.captured.input_updates):
            warnings.warn("autofuse: an input the forward updates in place shares memory with another input of this "
                          "call; the captured graph takes them as independent values, so this call runs the model "
                          "eagerly.", stacklevel=6)
            return self.model(*args, **kwargs)
        gm = self.graph_module
        if torch.is_grad_enabled() and keeps_checkpoints(self.captured.graph_module):
            gm = self._with_checkpoints()
        with _autocast_off():
            # its forward, not its __call__: torch's global module hooks, which capture ran into the graph for the
            # user's modules, would fire for this internal module too (a hook given its tuple of outputs)
            out = gm.forward(*leaves)
        out = out if isinstance(out, (tuple, list)) else (out,)
        self.captured.update_state(out, self.model, leaves)   # state the forward updates: a BatchNorm's
        #                                                        statistics, a static KV cache's tensors
        out = self.captured.unflatten_outputs(out, leaves)
        return caches.adopt((args, kwargs), out)     # a cache given is updated in place and returned, as eager does


def _aliased(leaves, updated) -> bool:
    """Whether an input the forward updates in place shares its storage with another tensor input (the same tensor
    passed twice, overlapping views): eager's later reads of the other see the update, the graph's do not."""
    storages = {}
    for i, t in enumerate(leaves):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storages.setdefault(t.untyped_storage().data_ptr(), []).append(i)
    return any(len(ix) > 1 and any(i in updated for i in ix) for ix in storages.values())


#: torch's fused fast paths of its transformer modules (an aten op each): opaque to every pattern
_FAST_PATHS = (torch.ops.aten._transformer_encoder_layer_fwd.default,
               torch.ops.aten._native_multi_head_attention.default)


def compile_plan(model, args, kwargs, device, level, budget, route="auto", verify=True, switches=None,
                 sizes=None, verdicts=None, agreed=None, at_call=False, twins=()) -> Plan:
    """Capture ``model`` on ``(args, kwargs)`` and build its fused plan (see the module docstring). ``sizes``: the
    :class:`autofuse.sizes.SizeFamilies` whose symbolic exports may serve this capture; ``verdicts``: a dict of
    verification verdicts kept across plans (``_Verifier``'s ``shared``); ``agreed``: a dict of the ranks'
    agreements on communicating blocks kept across plans (:class:`autofuse.agreement.Agreement`'s ``store``);
    ``at_call``: the inputs are a call's, not fuse()'s example inputs (errors say so); ``twins``: plans made for
    calls that differ from this one only in the values of inputs the graph may not read (FusedModule._twins): the
    first whose capture is this call's (:func:`graph_changes`) serves it, returning this call's numbers where the
    graph returns numbers (:meth:`Plan.with_outputs`), instead of planning the same graph again."""
    who = "fused model" if at_call else "fuse"
    _check_parameter_dtypes(model, device, who)      # model.double() after fuse(): refused as fuse() refuses it
    t0 = time.perf_counter()
    captured = capture(model, args, kwargs, route=route, sizes=sizes)
    # float64 inputs are decided on the captured graph: accepted where the model casts them before computing
    _check_input_dtypes(captured.graph_module, args, kwargs, device, who,
                        "this call's input" if at_call else "example input")
    for twin in twins:
        changes = _capture_changes(twin.captured, captured)
        if changes is not None:
            served = twin.with_outputs(changes, captured) if changes else twin
            if served is not None:
                return served
    with _autocast_off():       # the captured graph holds autocast's casts: checked and planned as it will run
        return _plan_captured(model, args, kwargs, device, level, budget, verify, switches, verdicts, captured, t0,
                              agreed)


def _pass_inplace_all_reduce_gradients(gm: fx.GraphModule) -> None:
    """An in-place ``torch.distributed.all_reduce(t)`` left unfused: eager autograd does not see it (c10d has no
    autograd kernel), so the gradient passes through unchanged; the captured graph holds it as a functional
    all_reduce, whose autograd all-reduces the gradient (p times eager's for a row-parallel layer). Its result is
    read through :data:`~autofuse.grad_ops.PASS_GRADIENT` of the reduced value and the tensor reduced, so the
    gradient goes as in eager (a fused pair's op takes its ``backward`` from the same test)."""
    from patterns.mc2 import WAIT, c10d_inplace_all_reduce
    changed = False
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not torch.ops._c10d_functional.all_reduce.default or \
                not c10d_inplace_all_reduce(n):
            continue
        for wait in [u for u in n.users if u.target is WAIT]:
            with gm.graph.inserting_after(wait):
                passed = gm.graph.call_function(PASS_GRADIENT, (wait, n.args[0]))
            passed.meta.update(wait.meta)
            wait.replace_all_uses_with(passed, delete_user_cb=lambda u: u is not passed)
            changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


def _check_lookups(cap_gm: fx.GraphModule, leaves: list):
    """Before planning: the example inputs' ids fall within the tables they index (an embedding's rows). Capture
    traces on fake tensors, which hold no ids; eager raises torch's bare ``index out of range in self`` on such
    inputs, and so would verification, deep in the plan. Ids given as inputs are read from them; ids the graph
    computes, from a run of the captured graph up to them (usually its first nodes); meta inputs hold no ids."""
    if _is_meta(leaves):
        return
    lookups = [n for n in cap_gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.embedding.default
               and isinstance(n.args[1], fx.Node)]
    if not lookups:
        return
    ids = {n.name: v for n, v in zip((n for n in cap_gm.graph.nodes if n.op == "placeholder"), leaves)}
    computed = {n.args[1].name for n in lookups} - ids.keys()
    if computed:
        ids.update(_Values(cap_gm, computed).values(*leaves))
    for n in lookups:
        rows = n.args[0].meta["val"].shape[0]
        got = ids.get(n.args[1].name)
        if not isinstance(got, torch.Tensor) or not got.numel():
            continue
        lo, hi = int(got.min()), int(got.max())
        if lo < 0 or hi >= rows:
            src = n.args[1]
            named = f"example input {src.name!r} holds" if src.op == "placeholder" else f"its ids ({src.name}) hold"
            raise ValueError(f"fuse: the example inputs fail to run the model eagerly: {describe_node(n)} looks up "
                             f"rows of a table of {rows}, and {named} ids from {lo} to {hi} (index out of "
                             f"range): give ids in [0, {rows}), as the model takes them eagerly")


def _plan_captured(model, args, kwargs, device, level, budget, verify, switches, verdicts, captured, t0,
                   agreed=None) -> Plan:
    cap_gm = captured.graph_module
    _check_lookups(cap_gm, pytree.tree_leaves((args, kwargs)))
    t1 = time.perf_counter()
    gm = canonicalize(cap_gm)
    t2 = time.perf_counter()
    matches = all_candidates(gm)
    t3 = time.perf_counter()
    leaves = pytree.tree_leaves((args, kwargs))
    agreement = Agreement.for_graph(cap_gm, device, agreed)      # ranks that communicate decide those blocks alike
    checker = _Verifier(cap_gm, leaves, device, level, verdicts, agreement is not None) if verify else None
    applied, decisions, cands = plan(cap_gm, gm, matches, device, level, budget, checker, switches, agreement)
    if not cap_gm.meta.get("autofuse_grad", True):
        cap, out = {n.name: n for n in cap_gm.graph.nodes}, returned(cap_gm)
        # fused across a value it returns: right without grad, not for a call autograd may differentiate
        gm.meta["autofuse_returned_read"] = any(returned_and_read(c, cap, out) for c in applied)
    predicted = baselines(cap_gm, gm, cands, decisions, device)
    t4 = time.perf_counter()
    by_lift = {id(c.lifted): c for c in applied}

    def kwargs_for(lifted):
        c = by_lift[id(lifted)]
        return family_of(c.match).op_kwargs(device, c.fused, level)

    fused = rewrite(cap_gm, [c.lifted for c in applied], lambda m: family_of(m).emit, kwargs_for)
    if cap_gm.meta.get("autofuse_grad", True):
        _pass_inplace_all_reduce_gradients(fused)
    if keeps_checkpoints(cap_gm):
        checkpointing.mark_fused_calls(fused, cap_gm)
    t5 = time.perf_counter()
    workspace = {c.match.anchor: c.fused.workspace for c in applied}

    def kernel_workspace(n):
        match = lead_match(n) if is_fused_call(n) else None
        return workspace.get(match.anchor, 0) if match is not None else 0

    guards = [Guard(fqn, state_tensor(model, fqn), False) for fqn in sorted(set(_state_nodes(cap_gm).values()))]
    relied = sorted({g for c in applied for g in c.match.params.get("guards", ())})
    guards += [Guard(fqn, state_tensor(model, fqn), True) for fqn in relied]
    guards += tied_guards(model, _state_nodes(cap_gm).values())
    guards.insert(0, ModuleGuard(model))            # checked first: a swapped module explains the rest
    report = FusionReport(device=device, optimization_level=level, memory_budget=budget, decisions=decisions,
                          peak_memory_unfused=memory.peak_bytes(cap_gm),
                          peak_memory_fused=memory.peak_bytes(fused, kernel_workspace),
                          nodes_before=len(cap_gm.graph.nodes), nodes_after=len(fused.graph.nodes),
                          capture_route=captured.route, training=captured.training,
                          predicted_cycles=predicted.pop("fused"), baselines=predicted,
                          fusion_switches=dict(switches or {}),
                          guards=[g.describe() for g in guards if g.value] + [guards[0].describe()],
                          timings={"capture_s": t1 - t0, "canonicalize_s": t2 - t1, "match_s": t3 - t2,
                                   "plan_s": t4 - t3, "rewrite_s": t5 - t4})
    if budget is not None and report.peak_memory_fused > budget:
        kept = sum(d.reason_code == "memory_budget" for d in decisions)
        report.warnings.append(
            f"the fused graph's peak activation memory {report.peak_memory_fused:,} B exceeds the budget {budget:,} B "
            f"(unfused: {report.peak_memory_unfused:,} B): the budget bounds each fused kernel's working set (its "
            f"inputs, outputs and workspace), not the graph's peak"
            + (f"; {kept} candidate(s) stayed unfused because theirs exceeds it, which can leave the peak higher than "
               f"fusing them would" if kept else ""))
    hooked = _hooked_modules(model)
    if hooked:
        report.warnings.append(f"module(s) {', '.join(hooked)} have hooks: capture ran their forward hooks (once per "
                               f"trace) into the graph, not at fused calls (a hook that records tensors recorded "
                               f"traced ones, not each call's), and backward hooks do not fire through fused calls; "
                               f"run the model eagerly to use them")
    observers = _hooked_modules(model, _HOOKS[:2])
    if observers:
        # a hook that records activations or counts calls does nothing at fused calls: said where the user sees it
        warnings.warn(f"autofuse: forward hooks of module(s) {', '.join(observers)} ran while this plan was captured "
                      f"(what a hook returns is part of the fused graph), not at fused calls: a hook that records or "
                      f"counts saw the trace's tensors, which fail when used later. Remove such hooks before fuse(), "
                      f"or run the model eagerly for them.", stacklevel=4)
    backward = _hooked_modules(model, _HOOKS[2:])
    if backward and torch.is_grad_enabled():
        # a hook that changes a gradient (clipping, scaling) would change eager's: said where the user sees it
        warnings.warn(f"autofuse: backward hooks of module(s) {', '.join(backward)} do not fire through the fused "
                      f"graph (its backward is not the modules' own); gradients a hook would change differ from "
                      f"eager's. Run the model eagerly to use them, or register hooks on parameters "
                      f"(param.register_hook), which fire.", stacklevel=4)
    # activation checkpoints the trace ran through (transformers' layers checkpoint only where the forward reads
    # torch.is_grad_enabled() as True: the trace reads eager's mode)
    if keeps_checkpoints(cap_gm):
        calls = len({checkpoint_of(n) for n in cap_gm.graph.nodes} - {None})     # a function checkpointed twice
        report.warnings.append(
            f"{calls} activation checkpoint(s) in the forward (torch.utils.checkpoint; transformers' "
            f"activation_checkpointing_enable()) are kept: a call with grad runs each one's ops, fused calls included, "
            f"through torch's non-reentrant checkpoint, so the backward recomputes them as eager's does, and "
            f"generated Vector regions keep to one checkpoint. The simulated training step "
            f"(simulate(backward=True)) prices the recomputation as a phase of its own")
    grad_free = cap_gm.meta.get("autofuse_grad_free_checkpoints", 0)
    if grad_free:
        # eager's CheckpointFunction warns at each call; the plan says it once
        _said(report, f"{grad_free} reentrant activation checkpoint(s) (use_reentrant=True) have no input that "
                      f"requires grad: as in eager (torch warns \"None of the inputs have requires_grad=True. "
                      f"Gradients will be None\"), their outputs carry no gradient and the parameters they use get "
                      f"none through them; pass an input that requires grad, or use use_reentrant=False, to train them")
    opaque = sorted({str(n.target).split(".")[-2] for n in cap_gm.graph.nodes if n.target in _FAST_PATHS})
    if opaque:
        # nn.TransformerEncoderLayer / nn.MultiheadAttention in eval without grad, as Dynamo traces them: torch's
        # own fused kernels, whose insides no pattern sees
        report.warnings.append(f"the graph calls torch's fast-path kernel(s) {', '.join(opaque)} (torch's "
                               f"nn.TransformerEncoderLayer or nn.MultiheadAttention in eval without grad), which "
                               f"run as torch's own: nothing inside them is fused, and each is priced as one generic "
                               f"pass over the bytes it moves, not its work. To fuse those layers, call "
                               f"torch.backends.mha.set_fastpath_enabled(False) before torch.compile (Dynamo then "
                               f"traces their composite path: the same values up to rounding), or fuse the model "
                               f"with autofuse.AutoFusionEngine.fuse")
        warnings.warn("autofuse: " + report.warnings[-1], stacklevel=2)
    kept = [CUSTOM_FUNCTIONS[n.args[2]].where if n.target is CUSTOM_FUNCTION else USER_FUNCTIONS[n.args[1]].where
            for n in cap_gm.graph.nodes if n.target in (CUSTOM_FUNCTION, USER_FUNCTION_OP)]
    if kept:
        # (through torch.compile: autofuse.backend keeps them so; in fuse(), capture's second trace)
        report.warnings.append(f"{len(kept)} custom autograd.Function application(s) whose backward is not (or "
                               f"could not be checked to be) the forward's derivative run as one op each with "
                               f"their own backward (no kernel of autofuse's: each priced as one generic Vector "
                               f"pass over its bytes); the graph fuses around them: " + "; ".join(dict.fromkeys(kept)))
    made = Plan(captured, _make_live(fused, model), report, gm, guards, model)
    if cap_gm.meta.get("autofuse_autograd_reads") or cap_gm.meta.get("autofuse_custom_functions"):
        # a custom autograd.Function's backward is not kept: accepted only while nothing requires grad, or where
        # its backward is its forward's derivative (capture checks), so a call that unfreezes a parameter
        # captures again
        made.autograd = autograd_state(model, args, kwargs)
    return made


def autograd_state(model, args, kwargs) -> tuple:
    """What a forward's reads of autograd state depend on: the grad mode, and which of the call's tensors and the
    model's parameters require grad."""
    return (torch.is_grad_enabled(),
            tuple(bool(getattr(x, "requires_grad", False)) for x in pytree.tree_leaves((args, kwargs))),
            tuple(p.requires_grad for p in model.parameters()))


#: Ops that only reshape their first argument: a random verification input made through them shares its values.
_RESHAPES = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default,
             torch.ops.aten.alias.default, torch.ops.aten.detach.default}


def _reshapes(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in _RESHAPES and isinstance(n.args[0], fx.Node)


def _reshape(n: fx.Node, base: torch.Tensor, sizes: dict):
    """``n``'s reshape applied to ``base`` (reduced shapes: its shape arguments reduced too); None when the
    reduced shapes do not reshape that way."""
    try:
        return n.target(base, *(_verify.shrink_arg(a, sizes) for a in n.args[1:]))
    except RuntimeError:
        return None


def _canonical(fam, cand):
    return fam.canonical(cand.match, list(cand.lifted.targets)) if fam.canonical is not None else None


def _reshaped(n: fx.Node) -> fx.Node:
    """The value ``n`` is a reshape of (``n`` itself when it is not one)."""
    while _reshapes(n):
        n = n.args[0]
    return n


class _Verifier:
    """``verify(candidate)`` for the planner (see :mod:`autofuse.verify`).

    The fused call is checked against the captured block it replaces, on the example inputs' values at the
    block's inputs (one eager run of the captured graph, only when a block needs them) and on adversarial
    inputs derived from the match. Identical blocks (same captured structure, same fused call) are
    verified once, in a plan and (``shared``) across a fused module's plans. On meta inputs, the values are
    random tensors of the recorded shapes (constants of the graph, such as a causal mask built from ``arange``,
    are evaluated).

    ``shared``: verdicts kept across the plans of one fused module (a decode step's norms and MLP are the same
    blocks at every cache length), by the same key and whether the inputs are meta; not for blocks that
    communicate, whose verdicts every rank agrees on as it plans.

    ``collectives``: the captured graph communicates (ranks planning together, :mod:`autofuse.agreement`). A block
    whose inputs the graph computes through a collective is checked on random values of its inputs' shapes, as on
    meta inputs: a run of the captured graph up to them would run its collectives, which the other ranks pair only
    when they want the same values (their blocks differ with their shards and settings; a rank may plan alone).
    """

    def __init__(self, captured, leaves, device, level, shared=None, collectives=False):
        self.cap, self.leaves, self.device, self.level = captured, leaves, device, level
        self.meta = _is_meta(leaves)
        self.communicated = set()       # names of the captured values computed through a collective
        if collectives:
            for n in captured.graph.nodes:
                if collective_group(n) is not None or any(a.name in self.communicated for a in n.all_input_nodes):
                    self.communicated.add(n.name)
        self.done = {}
        self.shared = shared
        self.blocks = {}        # id(candidate) -> (family, captured block, fused block, its inputs, key)
        self.values = {}        # captured node name -> its value on the example inputs (full-size checks)

    def _block(self, cand):
        if id(cand) not in self.blocks:
            fam = family_of(cand.match)
            kwargs = fam.op_kwargs(self.device, cand.fused, self.level)
            sub, fused_sub, external = fused_block(self.cap, cand.lifted, fam.emit, kwargs)
            key = (_verify.structure_key(sub), _verify.structure_key(fused_sub))
            self.blocks[id(cand)] = fam, sub, fused_sub, external, key
        return self.blocks[id(cand)]

    def prepare(self, cands):
        """Before ``cands`` are checked: the example values every one of them checked at its own size reads,
        from one run of the captured graph (each block asking for its own would run it once per block)."""
        if self.meta:
            return
        want = set()
        for cand in cands:
            fam, sub, _, external, key = self._block(cand)
            self._kept(fam, key)
            if key not in self.done and not self._too_large(sub) and not self._communicated(external):
                want |= {n.name for n in external} - self.values.keys()
        if want:
            self.values.update(_Values(self.cap, want).values(*self.leaves))

    def _communicated(self, external) -> bool:
        return any(n.name in self.communicated for n in external)

    @staticmethod
    def _too_large(sub) -> bool:
        """Checked on reduced shapes where the family has them (see ``_reduced``)."""
        return _verify.largest_value_bytes(sub) > _verify.LARGEST_CHECKED

    def _inputs(self, external, sizes=None, strict=False):
        """Values of the block's inputs. At reduced sizes (a block too large to check at its own), as on meta
        inputs: random values of the reduced shapes and the graph's constants evaluated (a causal mask), so
        that no block needs a run of the whole captured graph up to it."""
        sizes = sizes or {}
        if self.meta or sizes or self._communicated(external):
            gen = torch.Generator().manual_seed(0)
            made = {}

            def value(n):
                # inputs that are views of one value (Mixtral's experts read the hidden states through two
                # reshapes) are that value's views here too, so the block sees what the model gives it
                if n not in made:
                    t = _reshape(n, value(n.args[0]), sizes) if _reshapes(n) else None
                    want = [sizes.get(d, d) for d in n.meta["val"].shape] if "val" in n.meta else None
                    if strict and _reshapes(n) and (t is None or (want is not None and list(t.shape) != want)):
                        raise ValueError(f"{n.name}: its reshape of {n.args[0].name} does not give "
                                         f"{want} at these sizes")
                    if t is None:               # not a reshape, or a reduced base that does not reshape that way
                        # None for the user's (meta) parameters and buffers; a constant as large as a proof reads
                        # (a long sequence's mask) is evaluated too: the captured block reads what the plan proved
                        c = evaluate_constant(n, max_numel=LARGEST_CONSTANT)
                        t = (_verify.shrink_value(c, sizes) if isinstance(c, torch.Tensor)
                             else _verify.random_like(n, gen, sizes))
                    made[n] = t
                return made[n]
            return [_verify.laid_out(value(n), n) for n in external]
        missing = {n.name for n in external} - self.values.keys()
        if missing:
            self.values.update(_Values(self.cap, missing).values(*self.leaves))
        return [_verify.laid_out(_verify.shrink_value(self.values[n.name], sizes), n) for n in external]

    @staticmethod
    def _roles(lifted, external) -> dict:
        pos = {n.name: i for i, n in enumerate(external)}
        roles = {}
        for role, src in lifted.sources.items():
            if isinstance(src, str):
                continue
            names, stack, seen = [], [src], set()
            while stack:
                c = stack.pop()
                if c in seen:
                    continue
                seen.add(c)
                o = source(c, pos, lifted.reads)
                if o is not None:
                    names.append(pos[o])
                else:
                    stack.extend(c.all_input_nodes)
            roles[role] = names
        return roles

    def _gradients(self, fam) -> bool:
        """Whether the block's gradients are checked too: in a plan for training, made with grad (its backward
        will run), for the families whose backward is a Vector program derived from the forward's."""
        meta = getattr(self.cap, "meta", {})
        return fam.name in _DERIVED_BACKWARD and bool(meta.get("autofuse_training")) and \
            bool(meta.get("autofuse_grad", True))

    def _kept(self, fam, key):
        """The key of this block's verdict among the shared ones (None when not shared); a verdict found there is
        this plan's too."""
        if self.shared is None or fam.agree is not None:
            return None
        kept = (self.meta, key, self._gradients(fam))
        if key not in self.done and kept in self.shared:
            self.done[key] = self.shared[kept]
        return kept

    def __call__(self, cand):
        fam, sub, fused_sub, external, key = self._block(cand)
        kept = self._kept(fam, key)
        if key not in self.done:
            roles = self._roles(cand.lifted, external)
            if cand.match.params.get("causal_value") is not None:
                # a proven causal mask: a constant the plan's guards pin, so no adversarial mask; the run-time
                # bound's other branch (the mask read) is exercised by the large-magnitude q and k sets
                roles = {r: p for r, p in roles.items() if not r.startswith("mask")}
            # masks subtracted from the scores (a negative factor) mask with +inf and finfo.max
            negated = frozenset(r for r, kind, f in cand.match.params.get("mask_terms") or ()
                                if kind == "additive" and f < 0)
            tied = _verify.entangled_inputs(external)
            with torch.random.fork_rng():
                try:
                    grads = self._gradients(fam)
                    self.done[key] = self._reduced(fam, cand, sub, fused_sub, external, roles, grads, negated,
                                                   tied) or \
                        _verify.verify_block(sub, fused_sub, self._inputs(external), roles, _canonical(fam, cand),
                                             grads, negated, tied) + ("",)
                except Exception as e:  # noqa: BLE001 - a block that cannot be checked is not applied
                    why = str(e).splitlines()[0][:200] if str(e) else ""
                    self.done[key] = (False, None, None, "", f"not verified: checking it raised {type(e).__name__}"
                                                             f"{': ' + why if why else ''}")
            if fam.agree is not None:      # a call that communicates: every rank must apply the same fusions
                self.done[key] = fam.agree(self.done[key], cand.match)
            if kept is not None:
                if len(self.shared) >= MAX_SHARED_VERDICTS:
                    self.shared.clear()
                self.shared[kept] = self.done[key]
        return self.done[key]

    def _reduced(self, fam, cand, sub, fused_sub_full, external, roles, grads=False, negated=frozenset(),
                 tied=frozenset()):
        """A block too large to check at its size (its float64 reference would allocate more than
        ``verify.LARGEST_CHECKED`` at once) is checked on reduced shapes of the same block: its sequence or
        token dims (the family says which) shrunk in every shape argument and input, its fused call built for
        those shapes with the kernel's default tiling. A family may offer several reductions (sizes that
        coincide in a model can make one fail to run): the first that runs decides (those whose inputs do not
        reshape consistently are passed over without a run). None when the block is small
        enough. When none runs, the block is checked at its own size if one value of it stays within
        ``verify.LARGEST_AT_OWN_SIZE`` (the note says so; it can take minutes and gigabytes); above that it is
        left unverified, and so unfused, with the reason."""
        if not self._too_large(sub):
            return None
        options = fam.shrink(cand.match) if fam.shrink is not None else []
        options = [o for o in (options if isinstance(options, list) else [options]) if o]
        big = _verify.largest_value_bytes(sub)
        kwargs = fam.op_kwargs(self.device, type(cand.fused)(), "O2")          # default tiling for the new shapes
        failed, tried = [], 0
        for sizes in options:
            sizes = _verify.consistent_sizes(sub, sizes, [_reshaped(n) for n in external])
            what = ", ".join(f"{a} -> {b}" for a, b in sizes.items() if a != b)
            try:
                inputs = self._inputs(external, sizes, strict=True)     # cheap: views that do not hold fail here
                tried += 1
                if tried > MAX_REDUCTIONS:
                    break
                lifted = cand.lifted
                if fam.resize is not None:                                      # shapes held in the match itself
                    lifted = dataclasses.replace(lifted, match=fam.resize(lifted.match, sizes))
                _, fused_sub, _ = fused_block(self.cap, lifted, fam.emit, kwargs, sizes if fam.resize else None)
                small, small_fused = _verify.shrink(sub, sizes), _verify.shrink(fused_sub, sizes)
                ok, err, tol, label = _verify.verify_block(small, small_fused, inputs, roles, _canonical(fam, cand),
                                                           grads, negated, tied)
            except Exception as e:  # noqa: BLE001 - a reduction that does not run: try the next
                reason = str(e).splitlines()[0][:160] if str(e) else ""
                failed.append(f"({what}): {type(e).__name__}{': ' + reason if reason else ''}")
                continue
            note = f"verified on reduced shapes ({what}): the block at its size needs " \
                   f"{big / 2 ** 20:,.0f} MiB for one float64 value"
            return ok, err, tol, label or "", note
        why = "no reduced shape for it" if not failed else \
            f"no reduced shape runs ({'; '.join(failed[:2])}{f'; {len(failed) - 2} more' if len(failed) > 2 else ''})"
        if big > _verify.LARGEST_AT_OWN_SIZE:
            return False, None, None, "", (f"not verified: the block at its size needs {big / 2 ** 20:,.0f} MiB for "
                                           f"one float64 value (checks run at up to "
                                           f"{_verify.LARGEST_AT_OWN_SIZE / 2 ** 20:,.0f} MiB) and {why}")
        ok, err, tol, label = _verify.verify_block(sub, fused_sub_full, self._inputs(external), roles,
                                                   _canonical(fam, cand), grads, negated, tied)
        return ok, err, tol, label or "", f"verified at its own size: {why}"


#: Families whose fused op's backward is a Vector program derived from its forward (checked in training plans).
_DERIVED_BACKWARD = ("vector_chain", "matmul_epilogue")
#: How many of a family's reductions whose inputs hold are run before a block is checked at its own size.
MAX_REDUCTIONS = 8
#: How many verdicts a fused module keeps across its plans (then it starts again).
MAX_SHARED_VERDICTS = 4096

#: a ``generate()`` that plans this many new input signatures (or more) says why, once per fused module
GENERATE_PLANS_HINT = 16


class FusedModule(torch.nn.Module):
    """The user's model with its fusible blocks replaced by fused NPU kernels (see :mod:`autofuse.engine`)."""

    def __init__(self, model, example_inputs, device, level, budget, route, verify, switches=None, max_plans=None,
                 share_exports=True):
        super().__init__()
        self._max_plans = max_plans
        self.model = model          # shared, not copied: parameters, buffers and modes are the user's
        self._device, self._level, self._budget, self._route, self._verify = device, level, budget, route, verify
        self._switches = dict(switches or {})
        self._plans: dict = {}
        self._last = None
        self._caches_ready = False
        self._encoder = None        # an encoder-decoder's encoder, fused for generate()
        # one export serves a signature's other sizes (autofuse.sizes)
        self._sizes = SizeFamilies(make_guard=ModuleGuard) if share_exports else None
        self._verdicts: dict = {}       # verification verdicts by block, kept across plans
        self._agreed: dict = {}         # the ranks' agreements on communicating blocks, kept across plans
        # state_dict() has the model's own keys, and load_state_dict() takes them: a checkpoint of either loads
        # into the other (the submodule's name "model." is not part of the user's state)
        self.register_state_dict_post_hook(_model_keys)
        self.register_load_state_dict_pre_hook(_submodule_keys)
        # from here on, assigning a name the model has and this module does not reaches the model (__setattr__)
        self.__dict__["_autofuse_built"] = True
        self.__dict__["_called"] = False        # a plan of fuse()'s example inputs (its errors say so)
        self.__dict__["_made"] = [0, 0.0]       # plans made, and their seconds by stage summed (generate()'s hint)
        self.__dict__["_hinted"] = False
        if example_inputs is not None:
            args, kwargs = self._in_program_order(*example_inputs)
            self._plan_for(args, kwargs)
        self.__dict__["_called"] = True         # plans from here on are made at a call

    def _models_name(self, name) -> bool:
        """Whether ``name`` is one of the model's attributes that this module does not have itself (it reads it
        through, :meth:`__getattr__`): assigning or deleting it reaches the model."""
        d = self.__dict__
        if not d.get("_autofuse_built") or name in d or name.startswith("__") or hasattr(type(self), name) or \
                any(name in d.get(store, ()) for store in ("_parameters", "_buffers", "_modules")):
            return False
        model = d["_modules"].get("model")
        return model is not None and hasattr(model, name)

    def __setattr__(self, name, value):
        """``fused.fc2 = nn.Linear(...)`` sets the model's ``fc2`` (which ``fused.fc2`` reads), so the next call
        plans again with it and ``state_dict()`` holds its weights; a name the model does not have (or this
        module's own) is set on this module."""
        if self._models_name(name):
            setattr(self.__dict__["_modules"]["model"], name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name):
        if self._models_name(name):
            delattr(self.__dict__["_modules"]["model"], name)
        else:
            super().__delattr__(name)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """The model's own ``load_state_dict``: strict mode's error and the missing / unexpected keys name the
        model's keys (through the hooks, a ``"model."`` prefix, this module's submodule, showed in them)."""
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)

    #: What a fused module keeps of its plans (compiled graphs bound to its model): a deep copy starts them anew.
    _PLAN_STATE = frozenset({"_plans", "_last", "_caches_ready", "_encoder", "_sizes", "_verdicts", "_agreed",
                             "_spec_paths", "_modules"})

    def __deepcopy__(self, memo):
        """A fused module of a deep copy of the model, with the same settings and no plans yet (the first call
        of each signature plans again): plans hold compiled graphs bound to this module's model. Everything else
        is deep-copied as ``nn.Module`` copies it: hooks registered on this module, its training flag, attributes
        and submodules set on it."""
        model = copy.deepcopy(self.model, memo)
        new = FusedModule(model, None, self._device, self._level, self._budget, self._route, self._verify,
                          self._switches, self._max_plans, self._sizes is not None)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k not in self._PLAN_STATE:
                new.__dict__[k] = copy.deepcopy(v, memo)
        for k, sub in self._modules.items():
            if k != "model":
                new._modules[k] = copy.deepcopy(sub, memo)
        return new

    def __copy__(self):            # a shallow copy as copy.copy makes one (pickling, below, is refused)
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __reduce_ex__(self, protocol):
        raise TypeError("a fused module holds compiled graphs and cannot be pickled or torch.save()d: save the model "
                        "(fused.model, or its state_dict()) and fuse it again after loading; copy.deepcopy(fused) "
                        "gives a fused module of a copy of the model")

    def _key(self, args, kwargs):
        if not self._caches_ready:      # a KV cache flattens into its tensors before the signature is taken
            self._caches_ready = caches.prepare(self.model, args, kwargs)
        key = _signature(args, kwargs), tuple(m.training for m in self.model.modules()), autocast_state()
        p = self._plans.get(key)
        if p is not None and p.without_grad_only and torch.is_grad_enabled():
            key += ("with grad",)       # planned without grad, not for autograd (see Plan.without_grad_only)
            p = self._plans.get(key)
        if p is not None and p.autograd is not None:
            state = autograd_state(self.model, args, kwargs)
            if state != p.autograd:     # the forward reads autograd state: a plan per state (see Plan.autograd)
                key += ("autograd", state)
        return key

    def _plan_for(self, args, kwargs) -> Plan:
        # a KV cache's sliding-window lengths flatten as sizes throughout (the signature, capture, the plan's
        # leaves): caches.lengths_tied
        with _PLANNING.planning(), caches.lengths_tied(self.model):
            return self._plan_for_locked(args, kwargs)

    def _plan_for_locked(self, args, kwargs) -> Plan:
        key = self._key(args, kwargs)
        p = self._plans.pop(key, None)       # put back last: the plans are kept in order of use
        why = p.failed_guard(self.model) if p is not None else None
        if p is None and self._plans:
            # a new signature: the model may have changed too (a module swapped for a new one in training mode
            # changes the key itself); plans whose guards fail are dropped, and the first reason is reported
            stale = {k: q.failed_guard(self.model) for k, q in self._plans.items()}
            stale = {k: w for k, w in stale.items() if w is not None}
            for k in stale:
                del self._plans[k]
            why = next(iter(stale.values()), None)
        if p is None or why is not None:
            if why is not None:
                self._verdicts.clear()              # the model changed: no earlier export or verdict serves it
                self._agreed.clear()
                if self._sizes is not None:
                    self._sizes.families.clear()
            twins = [] if why is not None else self._twins(key)
            p = compile_plan(self.model, args, kwargs, self._device, self._level, self._budget, self._route,
                             self._verify, self._switches, self._sizes, self._verdicts, self._agreed,
                             at_call=self._called, twins=twins)
            if why is not None:
                p.report.replanned_because = why
            if not any(p is q or p.twin_of is q for q in twins):       # planned, not served by a twin's plan
                made = self.__dict__["_made"]
                made[0], made[1] = made[0] + 1, made[1] + sum(p.report.timings.values())
        self._plans[key] = p
        while self._max_plans is not None and len(self._plans) > self._max_plans:
            self._plans.pop(next(iter(self._plans)))        # the least recently used: planned again if it returns
        self._last = p
        return p

    def _twins(self, key) -> list:
        """The plans whose keys differ from ``key`` only in the values of KV cache lengths lifted into inputs of their
        own (:class:`autofuse.caches.Length`: a static cache's sliding-window layers, whose length changes at every
        decode step). Their captured graphs may be this call's but for the new length they return: compile_plan
        then serves the call from that plan (:meth:`Plan.with_outputs`), instead of planning the same graph
        again."""
        bare = _without_lengths(key)
        if bare == key:                     # no lifted length in this call
            return []
        made = {id(p): p for k, p in self._plans.items() if p.twin_of is None and _without_lengths(k) == bare}
        return list(made.values())          # the plans made: one served by a twin serves nothing further

    def __call__(self, *args, **kwargs):
        """The forward with this module's own forward hooks, without torch's global module hooks: capture ran those
        into the plan's graph for the model (its own call included), as eager fires them once per module, and
        firing them for this module too applied them once more. With backward hooks of its own, or under
        TorchScript tracing or ``module.compile()``, torch's own call runs (global hooks included)."""
        d = self.__dict__
        fsdp2 = _fsdp2_module()
        if fsdp2 is not None and isinstance(self, fsdp2):
            # its pre-forward hook would fail inside FSDP (resizing a storage the plan holds), with no word of why
            raise TypeError(f"autofuse: this fused module was sharded by {FSDP2}: {FSDP2_UNSUPPORTED}")
        if getattr(self, "_compiled_call_impl", None) is not None or d["_backward_hooks"] or \
                d["_backward_pre_hooks"] or torch._C._get_tracing_state():
            return super().__call__(*args, **kwargs)
        if not (d["_forward_hooks"] or d["_forward_pre_hooks"]):
            return self.forward(*args, **kwargs)
        return self._call_with_own_hooks(args, kwargs)

    def _call_with_own_hooks(self, args, kwargs):
        """torch's ``Module._call_impl`` for forward hooks and pre-hooks, with this module's hooks only: their
        order, ``with_kwargs`` and ``prepend`` as registered, what a hook returns replacing the inputs or the output,
        and ``always_call`` hooks run when the forward raises."""
        d = self.__dict__
        called = set()
        result = None
        try:
            for hook_id, hook in tuple(d["_forward_pre_hooks"].items()):
                if hook_id in d["_forward_pre_hooks_with_kwargs"]:
                    res = hook(self, args, kwargs)
                    if res is not None:
                        if not (isinstance(res, tuple) and len(res) == 2):
                            raise RuntimeError(f"forward pre-hook must return None or a tuple of (new_args, "
                                               f"new_kwargs), but got {res}.")
                        args, kwargs = res
                else:
                    res = hook(self, args)
                    if res is not None:
                        args = res if isinstance(res, tuple) else (res,)
            result = self.forward(*args, **kwargs)
            for hook_id, hook in tuple(d["_forward_hooks"].items()):
                if hook_id in d["_forward_hooks_always_called"]:
                    called.add(hook_id)
                res = hook(self, args, kwargs, result) if hook_id in d["_forward_hooks_with_kwargs"] else \
                    hook(self, args, result)
                if res is not None:
                    result = res
            return result
        except Exception:
            for hook_id, hook in tuple(d["_forward_hooks"].items()):
                if hook_id in d["_forward_hooks_always_called"] and hook_id not in called:
                    try:
                        res = hook(self, args, kwargs, result) if hook_id in d["_forward_hooks_with_kwargs"] else \
                            hook(self, args, result)
                        if res is not None:
                            result = res
                    except Exception as e:  # noqa: BLE001 - as torch: the forward's error is the one raised
                        warnings.warn(f"module forward hook with ``always_call=True`` raised an exception that was "
                                      f"silenced as another error was raised in forward: {e}", stacklevel=2)
            raise

    def forward(self, *args, **kwargs):
        # as a run: no other thread captures meanwhile, whose export would make this thread's _tracing() true
        # (torch's exporting flag is process-wide) and swap fake tensors in for the model's parameters
        with _PLANNING.running():
            return self._forward(args, kwargs)

    def _forward(self, args, kwargs):
        if _tracing(args, kwargs):
            # traced by another capture (this module inside a model fused again, torch.export, torch.compile):
            # the model itself, so that the capture sees its ops and fuses them with the rest (planning here
            # would export inside the other trace)
            return self.model(*args, **kwargs)
        why = _transformed(args, kwargs, self.model)
        if why is not None:
            warnings.warn(f"autofuse: a fused module called {why}, for which the fused ops have no rules: this call "
                          f"runs the model itself, unfused (eager's values and derivatives)", stacklevel=4)
            return self.model(*args, **kwargs)
        args, kwargs = self._in_program_order(args, kwargs)
        return self._plan_for(args, kwargs)(*args, **kwargs)

    def _in_program_order(self, args, kwargs):
        """A call of a module that binds its inputs by an exported program's pytree spec (``ep.module()``, what
        ``fuse`` makes of an ``ExportedProgram``), with its keyword arguments and dict keys put in that spec's
        order: exporting such a module binds them by position, so a call naming them in another order than the
        export did (a tokenizer's ``input_ids, token_type_ids, attention_mask``) was planned with its inputs
        swapped. Any other model's call, or one whose inputs are not the spec's, is returned as it is."""
        spec = getattr(self.model, "_in_spec", None) if isinstance(self.model, fx.GraphModule) else None
        if not isinstance(spec, pytree.TreeSpec) or spec.type is not tuple or spec.num_children != 2:
            return args, kwargs
        paths = self.__dict__.get("_spec_paths")
        if paths is None:
            marks = [object() for _ in range(spec.num_leaves)]
            paths = [p for p, _ in pytree.tree_flatten_with_path(pytree.tree_unflatten(marks, spec))[0]]
            object.__setattr__(self, "_spec_paths", paths)
        given = pytree.tree_flatten_with_path((args, kwargs))[0]
        by_path = dict(given)
        if len(by_path) != len(given) or set(by_path) != set(paths):
            # bound by position, these inputs would take other inputs' places (eager's module refuses them)
            positional, named = spec.child(0).num_children, spec.child(1).context
            raise TypeError(f"this fused module's model is an exported program's module, which takes "
                            f"{positional} positional input(s) and the keyword input(s) {list(named)} (as it was "
                            f"exported); this call gives {len(args)} positional and {sorted(kwargs)}: call it as "
                            f"it was exported (keywords in any order)")
        kinds = self.__dict__.get("_spec_kinds")
        if kinds is None:
            vals = [n.meta.get("val") for n in self.model.graph.nodes if n.op == "placeholder"]
            kinds = [isinstance(v, torch.Tensor) for v in vals] if len(vals) == len(paths) else []
            object.__setattr__(self, "_spec_kinds", kinds)
        for p, tensor in zip(paths, kinds):
            if tensor != isinstance(by_path[p], torch.Tensor):
                given = by_path[p]
                raise TypeError(f"this fused module's model is an exported program's module, whose "
                                f"{_program_input_name(p)} was exported as "
                                f"{'a tensor' if tensor else 'a Python value (a constant of the program)'}; this call "
                                f"gives {'None' if given is None else type(given).__name__}: call it with the kinds of "
                                f"inputs it was exported with, or export the model again with these inputs")
        ordered_args, ordered_kwargs = pytree.tree_unflatten([by_path[p] for p in paths], spec)
        return tuple(ordered_args), dict(ordered_kwargs)

    def __getattr__(self, name):
        """The model's attributes read through the fused module (``fused.config``, ``fused.device``,
        ``fused.generation_config``, transformers' ``_supports_*`` flags), so code written for the model, such as
        transformers' assisted generation with a fused draft model, takes the fused one. The fused module's own
        attributes come first; special names (``__deepcopy__``) are never the model's."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_modules", {}).get("model")
            if name.startswith("__") or model is None:
                raise
        try:
            return getattr(model, name)
        except AttributeError:
            raise AttributeError(f"'FusedModule' object has no attribute {name!r}, nor has the "
                                 f"{type(model).__name__} it fuses") from None

    def generate(self, *args, **kwargs):
        """The model's own ``generate`` (transformers' ``GenerationMixin``) with every forward it makes run fused:
        prefill and each decode step, the KV cache updated in place as eager updates it (:mod:`autofuse.caches`),
        and an encoder-decoder's encoder (its own fused module, ``self.encoder_plans``). Each step whose sizes are
        new is planned as a new input signature; ``self.plans`` holds them all.

        It runs ``generate`` on a shallow copy of the user's model whose ``forward`` is this module's: the copy
        shares every submodule, parameter, buffer and setting with the model, and the model itself is left as
        it was."""
        if not callable(getattr(self.model, "generate", None)):
            raise AttributeError(f"{type(self.model).__name__} has no generate(); call the fused module on each "
                                 f"step's inputs instead (a KV cache passed in is updated as eager updates it)")
        stepper = copy.copy(self.model)      # its own __dict__, the same submodules, parameters and config

        @functools.wraps(self.model.forward)
        def forward(*a, **k):
            # the model's own signature, read by generate() to decide which inputs it builds and passes (an
            # attention mask from pad_token_id, position_ids from the mask, logits_to_keep)
            return self.forward(*a, **k)
        object.__setattr__(stepper, "forward", forward)
        if getattr(self.model.config, "is_encoder_decoder", False) and callable(getattr(self.model, "get_encoder",
                                                                                        None)):
            # generate() runs the encoder once by itself, through get_encoder(): that call is fused too
            if self._encoder is None:       # not a submodule: state_dict() and parameters() stay the model's
                object.__setattr__(self, "_encoder", FusedModule(self.model.get_encoder(), None, self._device,
                                                                 self._level, self._budget, self._route,
                                                                 self._verify, self._switches, self._max_plans,
                                                                 self._sizes is not None))
            object.__setattr__(stepper, "get_encoder", lambda *a, **k: self._encoder)
        count, seconds = self.__dict__["_made"]
        # the decode steps to come, when generate() is told: with five or more, their captures share one symbolic
        # export from the second step on; with fewer, each is exported by itself (SizeFamilies.expecting)
        tokens = self._generation_setting(kwargs, "max_new_tokens")
        steps = tokens - 1 if isinstance(tokens, int) else None
        with self._sizes.expecting(steps) if self._sizes is not None else contextlib.nullcontext():
            out = type(self.model).generate(stepper, *args, **kwargs)
        self._hint_generate(self.__dict__["_made"][0] - count, self.__dict__["_made"][1] - seconds, kwargs)
        return out

    def _generation_setting(self, kwargs, name):
        """A generate() setting as transformers resolves it: the keyword, else the ``generation_config`` passed, else
        the model's."""
        if name in kwargs:
            return kwargs[name]
        config = kwargs.get("generation_config") or getattr(self.model, "generation_config", None)
        return getattr(config, name, None)

    def _hint_generate(self, made: int, seconds: float, kwargs) -> None:
        """Once per module: a generate() that planned many new signatures says why (each cache length is one) and,
        unless its cache was static already, what keeps the decode steps on one."""
        if made < GENERATE_PLANS_HINT or self.__dict__["_hinted"]:
            return
        self.__dict__["_hinted"] = True
        # a static cache asked for, or passed in (under any keyword: transformers 5 names it cache=)
        static = self._generation_setting(kwargs, "cache_implementation") == "static" or \
            any(type(c).__name__ == "StaticCache" for c in caches.caches_in(kwargs))
        # a model with sliding-window layers plans every decode step with a static cache too (their length, a
        # Python int, is part of each step's signature): the advice would not spare it any plan
        advice = ("" if static or caches.has_windowed_layers(getattr(self.model, "config", None)) else
                  "; generate(..., cache_implementation='static') keeps one length for the decode steps, so that "
                  "most models plan them once")
        warnings.warn(f"autofuse: generate() planned {made} new input signatures ({seconds:.1f} s of planning): "
                      f"each new cache length is one, planned and checked once (a dynamic KV cache, transformers' "
                      f"default, grows by a token at every step, and a sliding-window layer's length is a Python "
                      f"int that changes at every step){advice}", stacklevel=3)     # the caller of generate()

    def _require_plan(self):
        if self._last is None:
            raise RuntimeError("this FusedModule has not been planned yet: call it once, or pass example_inputs "
                               "to AutoFusionEngine.fuse")
        return self._last

    @property
    def report(self) -> FusionReport:
        return self._require_plan().report

    @property
    def graph_module(self) -> fx.GraphModule:
        return self._require_plan().graph_module

    @property
    def plans(self) -> dict:
        return dict(self._plans)

    @property
    def encoder_plans(self) -> dict:
        """The plans of an encoder-decoder's encoder made by :meth:`generate` (empty before)."""
        return {} if self._encoder is None else self._encoder.plans

    def simulate(self, *args, values: bool = True, backward: bool = False, **kwargs):
        """Run the fused graph on the simulator (fused and unfused ops alike); see :func:`autofuse.simulate`
        (``values=False``: timing only, the same statistics without outputs; ``backward=True``: a training
        step, the forward and the backward the fused ops register, ``result.phases`` splits the cycles)."""
        import inspect

        from autofuse.simulate import simulate_graph
        try:
            sig = inspect.signature(self.model.forward)
        except (TypeError, ValueError):     # no signature to read: the capture names what does not fit
            sig = None
        try:
            if sig is not None:
                sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"simulate() runs the model on the inputs of a call, as fused(...) takes them: "
                            f"forward{sig} ({e})") from None
        with _PLANNING.running():           # it reads the model's parameters, as a fused call does
            p = self._plan_for(args, kwargs)
            return simulate_graph(p.graph_module, p.captured.flatten_inputs(*args, **kwargs), self._device,
                                  values=values, backward=backward)


def _fx_tracing() -> bool:
    t = fx._symbolic_trace
    return t.is_fx_symbolic_tracing() if hasattr(t, "is_fx_symbolic_tracing") else t.is_fx_tracing()


def _transformed(args, kwargs, model) -> str | None:
    """The derivative a call is made under that the fused ops cannot take, in words (None for none): a
    ``torch.func`` transform (``grad``, ``vmap``, ``jvp``, ``jacrev``, ...), or forward-mode AD with a tangent on an
    input, parameter or buffer (``torch.autograd.forward_ad``)."""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return "under a torch.func transform (grad, vmap, jvp, jacrev, ...)"
    if fwAD._current_level >= 0:
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        tensors += [*model.parameters(), *model.buffers()]
        if any(fwAD.unpack_dual(t).tangent is not None for t in tensors):
            return "with forward-mode AD tangents (torch.autograd.forward_ad)"
    return None


def _tracing(args, kwargs) -> bool:
    """Whether a call runs inside a capture: torch.export, Dynamo, fx's symbolic tracing, a proxy or fake tensor
    mode, or inputs that are fake tensors or fx proxies."""
    if torch.compiler.is_exporting() or torch.compiler.is_compiling() or _fx_tracing():
        return True
    if get_proxy_mode() is not None or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return True
    return any(isinstance(x, (FakeTensor, fx.Proxy)) for x in pytree.tree_leaves((args, kwargs)))


def generic_only() -> dict:
    """Fusion switches that turn every pattern family off: what automatic discovery alone does (the second
    baseline, "generic fusion alone")."""
    return {name: "off" for name in families() if name not in GENERIC}


class _WithSettings:
    """``fuse`` as the class gives it (``AutoFusionEngine.fuse(model, ...)``), or, on an instance, with the
    instance's device, level and budget wherever a call does not give its own."""

    def __init__(self, fuse):
        self.fuse = fuse

    def __get__(self, engine, owner=None):
        if engine is None:
            return self.fuse

        @functools.wraps(self.fuse)
        def fuse(model, example_inputs=None, target_device=None, optimization_level=None, memory_budget=_UNSET,
                 **options):
            return self.fuse(model, example_inputs,
                             engine.target_device if target_device is None else target_device,
                             engine.optimization_level if optimization_level is None else optimization_level,
                             engine.memory_budget if memory_budget is _UNSET else memory_budget, **options)
        return fuse


_UNSET = object()


def _model_keys(module, state, prefix, local_metadata):
    """A fused module's state_dict, keyed as its model's (``prefix + "model.x"`` -> ``prefix + "x"``)."""
    inner = prefix + "model."
    for k in [k for k in state if k.startswith(inner)]:
        state[prefix + k[len(inner):]] = state.pop(k)


def _submodule_keys(module, state, prefix, *_):
    """The model's keys given to a fused module's load_state_dict, as its submodule ``model`` holds them (every
    key: a model may have a submodule named ``model`` of its own, as transformers' ``*ForCausalLM`` do)."""
    for k in [k for k in state if k.startswith(prefix)]:
        state[prefix + "model." + k[len(prefix):]] = state.pop(k)


class AutoFusionEngine:
    """Entry point: ``AutoFusionEngine.fuse(model, ...)``, or an instance with fixed settings
    (``AutoFusionEngine("ascend910b", "O2", "16GB").fuse(model, ...)``; a call's own arguments win)."""

    def __init__(self, target_device="ascend910", optimization_level="O3", memory_budget=None):
        try:
            get_device(target_device)
        except ValueError as e:
            raise ValueError(f"AutoFusionEngine: target_device={target_device!r} is not a known device: "
                             f"{str(e).split(': ', 1)[-1]}") from None
        parse_level(optimization_level)
        parse_memory_budget(memory_budget)
        self.target_device, self.optimization_level, self.memory_budget = (target_device, optimization_level,
                                                                           memory_budget)

    def __repr__(self):
        return (f"AutoFusionEngine(target_device={self.target_device!r}, optimization_level="
                f"{self.optimization_level!r}, memory_budget={self.memory_budget!r})")

    @_WithSettings
    def fuse(model, example_inputs=None, target_device="ascend910", optimization_level="O3", memory_budget=None,
             *, route="auto", verify=True, fusion_switches=None, max_plans=64, share_exports=True,
             **unknown) -> FusedModule:
        """Fuse ``model`` (an ``nn.Module``, or a ``torch.export.ExportedProgram``: its module, planned on the
        inputs it was exported with unless ``example_inputs`` are given) for ``target_device``; see the module
        docstring.

        ``example_inputs``: a tuple of positional inputs, a single tensor, or ``(args, kwargs)`` with a dict as
        second element; tensors may be on the meta device (planning without data). ``memory_budget``: bytes
        (an int) or a string with a unit such as ``"16GB"`` (binary units: GB = GiB = 2**30 bytes; a string
        without a unit is refused, see :func:`autofuse.plan.parse_memory_budget`). ``fusion_switches``: pattern
        family -> ``"on"``, ``"off"`` or ``"force"`` (fuse whenever the kernel can run, profitable or not), like
        CANN's fusion switch file; a region's name (``"rope"``, ``"matmul+swiglu"``) may be switched too, and wins
        over its family's switch.
        ``max_plans``: how many input signatures' plans are kept (``None``: all); beyond it the least recently
        used is dropped and planned again if its signature returns. Generation makes one per cache length.
        ``share_exports``: a signature that differs from an earlier one only in sizes (a longer KV cache) is
        specialised from one symbolic ``torch.export`` of the family instead of being exported again
        (:mod:`autofuse.sizes`); ``False`` exports every signature by itself. Any other keyword is refused,
        naming the option it is closest to (``optimisation_level`` -> ``optimization_level``).
        """
        if unknown:
            raise TypeError(unknown_options("fuse", unknown))
        model, example_inputs, device = check_model(model, example_inputs, target_device)
        level = parse_level(optimization_level)
        budget = parse_memory_budget(memory_budget)
        switches = _check_switches(fusion_switches)
        if not isinstance(verify, bool):
            raise ValueError(f"fuse: verify={verify!r}; give True (every fused block is checked against the captured "
                             f"ops before it is used) or False (no check)")
        if max_plans is not None and (not isinstance(max_plans, int) or isinstance(max_plans, bool) or max_plans < 1):
            raise ValueError(f"fuse: max_plans={max_plans!r}; give a count of 1 or more, or None to keep every plan")
        if not isinstance(share_exports, bool):
            raise ValueError(f"fuse: share_exports={share_exports!r}; give True (one symbolic export serves a "
                             f"signature's other sizes) or False (export every signature by itself)")
        return FusedModule(model, _normalise_inputs(example_inputs), device, level, budget, route, verify, switches,
                           max_plans, share_exports)


def fuse_options() -> list[str]:
    """The keyword options of :meth:`AutoFusionEngine.fuse` (what :class:`autofuse.backend.Backend` passes on)."""
    import inspect
    params = inspect.signature(AutoFusionEngine.fuse).parameters
    return [n for n, p in params.items() if n not in ("model", "example_inputs") and p.kind != p.VAR_KEYWORD]


def unknown_options(who: str, given) -> str:
    """The message for keyword arguments that ``fuse()`` does not take: each with the option it is closest to, or
    the list of options."""
    from autofuse.models import did_you_mean
    known = fuse_options()
    parts = [f"{name!r}{did_you_mean(name, known)}" for name in given]
    return f"{who}: no option {', '.join(parts)}; the options are {', '.join(known)}"


def check_model(model, example_inputs, target_device, who: str = "fuse", device_arg: str = "target_device"):
    """What ``fuse()`` (and ``simulate()``, ``who``) checks of the model it is given before capturing it:
    ``(module, example_inputs, device name)``. An ``ExportedProgram`` gives its module, and its example inputs
    where none are given; anything but an ``nn.Module`` (a function, a class, a string), a TorchScript module or
    a data-parallel wrapper is refused with what to pass instead, and so is a device that is not known or a
    parameter the NPU does not compute in (float64)."""
    if isinstance(model, torch.export.ExportedProgram):
        # a program already exported: its module (the program's graph, reading the program's own parameters),
        # planned on the inputs it was exported with unless others are given
        if example_inputs is None and model.example_inputs is not None:
            example_inputs = model.example_inputs
        model = model.module()
    if isinstance(model, type) and issubclass(model, torch.nn.Module):
        raise TypeError(f"{who}: model is the class {model.__name__}, not a module: pass an instance of it "
                        f"({model.__name__}(...))")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{who}: model must be a torch.nn.Module or a torch.export.ExportedProgram, got "
                        f"{type(model).__name__}; wrap a function in a module (class M(nn.Module): def forward(self, "
                        f"...): return fn(...))" + (" or use torch.compile(fn, backend='autofuse')" if who == "fuse"
                                                     else ""))
    if isinstance(model, (torch.jit.ScriptModule, torch.jit.ScriptFunction)):
        raise TypeError(f"{who}: model is a TorchScript module ({type(model).__name__}, from torch.jit.script or "
                        f"torch.jit.trace), which torch.export cannot capture: pass the original nn.Module")
    wrapper = _data_parallel_wrapper(model)
    if wrapper == FSDP2:
        raise TypeError(f"{who}: model is sharded by {FSDP2}: {FSDP2_UNSUPPORTED}")
    if wrapper:
        instead = (f"fuse the module inside and wrap the fused one, {wrapper.split('.')[-1]}(AutoFusionEngine.fuse("
                   f"model, ...)), whose gradients the wrapper's hooks reduce as usual; or compile the wrapped model "
                   f"with torch.compile(wrapped, backend='autofuse')") if who == "fuse" else \
            "pass the module inside (wrapped.module)"
        raise TypeError(f"{who}: model is wrapped in {wrapper}, whose forward torch.export cannot capture (it "
                        f"synchronises buffers and registers gradient hooks at each call): {instead}")
    if holds_tensor(target_device):
        raise TypeError(f"{who}: {device_arg} is {_what_holds_tensors(target_device)}, which looks like an example "
                        f"input given after the first: {who}() takes every example input in its one argument "
                        f"example_inputs, a tuple of positional inputs or (args, kwargs) with keyword inputs in a "
                        f"dict, e.g. {who}(model, ((input_ids,), {{'attention_mask': mask}}))")
    try:
        device = get_device(target_device).name
    except ValueError as e:
        raise ValueError(f"{who}: {device_arg}={target_device!r} is not a known device: "
                         f"{str(e).split(': ', 1)[-1]}") from None
    _check_parameter_dtypes(model, device, who)
    return model, example_inputs, device


def _what_holds_tensors(value) -> str:
    """``value`` (a tensor, or a container holding tensors) as an error names it, without printing its values."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    if isinstance(value, dict):
        return f"a dict of tensors (keys {', '.join(repr(k) for k in value)})"
    return f"a {type(value).__name__} holding tensors"


#: FSDP2's wrapper as messages name it, and why autofuse refuses it (fuse() of it, and fully_shard of a fused module)
FSDP2 = "torch.distributed.fsdp.fully_shard (FSDP2)"
FSDP2_UNSUPPORTED = ("its parameters are DTensors whose storage FSDP2 gathers before each forward and frees after it, "
                     "which neither a captured graph nor a fused plan follows, so autofuse does not support FSDP2 "
                     "either way round (fully_shard of a fused module is refused at its first call). For data "
                     "parallelism wrap the fused module in DistributedDataParallel(AutoFusionEngine.fuse(model, ...)); "
                     "otherwise run the FSDP2 model eagerly")


@functools.cache
def _fsdp2_module():
    """FSDP2's ``FSDPModule`` (the class ``fully_shard`` mixes into a module's class), or None without it."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def _data_parallel_wrapper(model) -> str | None:
    """The name of the distributed data-parallel wrapper ``model`` is (``DistributedDataParallel``, FSDP's
    ``FullyShardedDataParallel``, :data:`FSDP2` for a module ``fully_shard`` made an ``FSDPModule`` of), or None.
    ``nn.DataParallel`` on the CPU calls its module as it is: it captures."""
    fsdp2 = _fsdp2_module()
    if fsdp2 is not None and isinstance(model, fsdp2):
        return FSDP2
    for cls in type(model).__mro__:
        if cls.__name__ in ("DistributedDataParallel", "FullyShardedDataParallel") and \
                cls.__module__.startswith("torch."):
            return f"{cls.__module__}.{cls.__name__}"
    return None


#: Element types the NPU computes in (the Cube takes fp16/bf16/fp32 operands; there is no float64 unit).
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _dtype_error(what: str, dtype, device: str, who: str = "fuse") -> TypeError:
    if dtype.is_complex:        # model.float() leaves complex tensors as they are
        return TypeError(f"{who}: {what} is {str(dtype).replace('torch.', '')}; the NPU target {device} computes in "
                         f"float16, bfloat16 and float32 (complex values as pairs of them): make it complex64 first "
                         f"(t.to(torch.complex64))")
    return TypeError(f"{who}: {what} is {str(dtype).replace('torch.', '')}; the NPU target {device} computes in "
                     f"float16, bfloat16 and float32: cast the model and its inputs first (model.float() and "
                     f"x.float(), or .half() / .to(torch.bfloat16))")


#: A complex dtype's parts: complex values stay as captured, as pairs of their parts' dtype (RoPE tables kept as
#: ``freqs_cis``), so a complex tensor of a compute dtype's pairs is one the target computes.
_PARTS = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}


def _bad_dtype(t) -> bool:
    return floating(t) and _PARTS.get(t.dtype, t.dtype) not in COMPUTE_DTYPES


def _check_parameter_dtypes(model: torch.nn.Module, device: str, who: str = "fuse"):
    for kind, items in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in items:
            if _bad_dtype(t):
                raise _dtype_error(f"{kind} {name!r} of {type(model).__name__}", t.dtype, device, who)


class InputDtypeError(TypeError):
    """An input of a dtype the NPU does not compute in (float64, complex128) that the captured graph computes with,
    not only casts to a dtype it computes in: the message names the first op that reads it so. ``leaf``: the
    input's position among the flattened inputs; ``read``: how the graph computes with it (:func:`first_wide_read`).
    """

    def __init__(self, message: str, leaf: int, read: str = ""):
        super().__init__(message)
        self.leaf, self.read = leaf, read


_aten = torch.ops.aten
#: Ops that view, slice, copy or re-lay a value without computing with it: a float64 input may pass them on its way
#: to a cast into a compute dtype (what they make is followed as the input is)
_MOVES = {_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.permute.default,
          _aten.transpose.int, _aten.t.default, _aten.unsqueeze.default, _aten.squeeze.default, _aten.squeeze.dim,
          _aten.squeeze.dims, _aten.expand.default, _aten.slice.Tensor, _aten.select.int, _aten.narrow.default,
          _aten.clone.default, _aten.detach.default, _aten.alias.default, _aten.contiguous.default,
          _aten.flatten.using_ints, _aten.unflatten.int, _aten.split.Tensor, _aten.split_with_sizes.default,
          _aten.unbind.int, _aten.chunk.default, _aten.movedim.int, _aten.lift_fresh_copy.default,
          _aten.view_as_real.default, _aten.view_as_complex.default, operator.getitem}
#: Casts: one into a compute dtype ends the float64 value's path; one that keeps float64 is followed as a move
_CASTS = {_aten._to_copy.default, _aten.to.dtype, _aten.to.dtype_layout, _aten.to.device, _aten.to.other,
          torch.ops.prims.convert_element_type.default}
#: Ops that read only a value's size, dtype or device (a new tensor of its shape): what they make is followed if it
#: is float64 too
_SIZE_READS = {_aten.sym_size.int, _aten.sym_size.default, _aten.sym_numel.default, _aten.sym_stride.int,
               _aten.sym_storage_offset.default, _aten.empty_like.default, _aten.zeros_like.default,
               _aten.ones_like.default, _aten.full_like.default, _aten.rand_like.default, _aten.randn_like.default,
               _aten.new_empty.default, _aten.new_zeros.default, _aten.new_ones.default, _aten.new_full.default}
_PASSED = _MOVES | _CASTS | _SIZE_READS


def _computed(dtype) -> bool:
    """Whether the target computes in ``dtype`` (a float or complex dtype of the compute dtypes, or any other kind:
    integers, bool)."""
    return not (dtype.is_floating_point or dtype.is_complex) or _PARTS.get(dtype, dtype) in COMPUTE_DTYPES


def _wide_leaves(value) -> list:
    """The tensors of ``value`` (a node's ``val``: a tensor, or a list of them) of a dtype the target does not
    compute in."""
    return [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor) and not _computed(v.dtype)]


def first_wide_read(gm: fx.GraphModule, start: fx.Node) -> str:
    """How the captured graph first reads ``start`` (a placeholder of a float64 or complex128 input) other than by
    moving it to a cast into a compute dtype, as a phrase (``"it is read in float64 by add (aten.add.Tensor) at
    file:line: code"``), or ``""`` where every path from it reaches such a cast (``x.to(self.weight.dtype)``, also
    after views, slices, copies and size reads) before any op computes with it."""
    from autofuse.capture import _stack_line
    seen, todo = {start}, [start]
    while todo:
        v = todo.pop(0)
        kind = str((_wide_leaves(v.meta.get("val")) or [start.meta["val"]])[0].dtype).replace("torch.", "")
        for u in v.users:
            if u in seen:
                continue
            if u.op == "output":
                return f"the model returns it{' (or a view of it)' if v is not start else ''} in {kind}"
            if u.op == "call_function" and u.target in _PASSED:
                out = u.meta.get("val")
                if u.target in _MOVES or _wide_leaves(out):      # a move, or a cast or size read keeping float64
                    seen.add(u)
                    todo.append(u)
                    continue
                if u.target in _SIZE_READS or isinstance(out, torch.Tensor) and (out.is_floating_point()
                                                                                 or out.is_complex()):
                    continue                                    # a size read, or a cast into a compute dtype
                # a cast into an integer or bool dtype rounds or compares the values: it computes with them
            where = _stack_line(u.meta.get("stack_trace") or "")
            return f"it is read in {kind} by {describe_node(u)}{f' at {where}' if where else ''}"
    return ""


def _check_input_dtypes(gm: fx.GraphModule, args, kwargs, device: str, who: str = "fuse",
                        input_: str = "example input"):
    """Refuse an input of a dtype the target does not compute in (float64, complex128) that the captured graph
    ``gm`` computes with: one the model casts into a compute dtype before any op computes with it (DINOv2's
    ``pixel_values.to(dtype=self.patch_embeddings.projection.weight.dtype)``, through views on the way) is
    accepted, and so is a 0-d tensor (a scalar: type promotion lets the other operands' dtype decide)."""
    named = [(f"{input_} {i}", a) for i, a in enumerate(args)] + [(f"{input_} {k!r}", v) for k, v in kwargs.items()]
    leaves = [(what, leaf) for what, value in named for leaf in pytree.tree_leaves(value)]
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for k, (what, leaf) in enumerate(leaves):
        if not (_bad_dtype(leaf) and leaf.dim() > 0):
            continue
        e = _dtype_error(what, leaf.dtype, device, who)
        if len(places) != len(leaves):          # not one placeholder per input: nothing to follow it by
            raise InputDtypeError(str(e), k)
        read = first_wide_read(gm, places[k])
        if read:
            raise InputDtypeError(f"{e}. {read[0].upper()}{read[1:]}; an input the model casts into its dtype "
                                  f"before computing with it (x.to(self.weight.dtype), as DINOv2 casts its "
                                  f"pixel_values) is accepted", k, read)


SWITCH_VALUES = ("on", "off", "force")
#: Names of discovered regions a switch may name too (the family that finds them is ``vector_chain``).
NAMES = ("rms_norm", "add_rms_norm", "layer_norm", "rope", "swiglu", "geglu")


def switch_name_known(name) -> bool:
    """Whether a fusion switch may name ``name``: a family, a region name, or a region's whole name as reports
    print it (``matmul+swiglu``, ``add_rms_norm+matmul``: names joined with ``+``, ``matmul`` among them)."""
    if not isinstance(name, str):
        return False
    if name in families() or name in NAMES:
        return True
    parts = name.split("+")
    return len(parts) > 1 and all(p in NAMES or p == "matmul" for p in parts)


def _check_switches(switches) -> dict:
    if switches is None:
        return {}
    if not isinstance(switches, dict):
        raise TypeError(f"fuse: fusion_switches must be a dict such as {{'attention': 'off'}}, got "
                        f"{type(switches).__name__}")
    known = set(families()) | set(NAMES)
    out = {}
    for name, value in switches.items():
        if not switch_name_known(name):
            raise ValueError(f"fuse: fusion_switches names {name!r}, which is not a pattern family; the families "
                             f"are {', '.join(sorted(known))}")
        if not isinstance(value, str) or value.lower() not in SWITCH_VALUES:
            raise ValueError(f"fuse: fusion_switches[{name!r}] = {value!r}; use one of {', '.join(SWITCH_VALUES)}")
        out[name] = value.lower()                # 'OFF' as 'off', as device names take any case
    return out


def _normalise_inputs(example_inputs):
    if example_inputs is None:
        return None
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        if len(example_inputs) == 2 and isinstance(example_inputs[0], (tuple, list)) and isinstance(
                example_inputs[1], dict):
            return tuple(example_inputs[0]), dict(example_inputs[1])
        return tuple(example_inputs), {}
    raise TypeError(f"fuse: example_inputs must be a tensor, a tuple of positional inputs, a dict of keyword "
                    f"inputs or (args, kwargs); got {type(example_inputs).__name__}")


__all__ = ["AutoFusionEngine", "FusedModule", "compile_plan", "generic_only"]
