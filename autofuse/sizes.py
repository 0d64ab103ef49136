"""One export for a signature's sizes: a model called again with the same structure at other sizes (a decode step
against a longer KV cache, a batch of another size) is specialised from one symbolic export instead of being
exported again.

``torch.export`` is most of the time ``fuse()`` spends on a new input signature (about 1.3 s of 1.8 s for a
two-layer Llama's decode step). Generation makes a signature per cache length, so a fused ``generate()`` spent
seconds per token exporting the same forward. :class:`SizeFamilies` keeps, per *family* (the inputs' pytree
structure, each leaf's type, dtype, device and rank, the non-tensor leaves' values, and the model's mode; a
sliding-window cache layer's length is a size, its keys' or an int input of its own, :mod:`autofuse.caches`):

1. its first signatures (two by default), each exported by itself as without sharing (static);
2. at the family's third signature (``plain_first``; at the second while generate() has five or more decode steps
   to make, and none while it has fewer: :meth:`SizeFamilies.expecting`), one export with
   ``torch.export.Dim.AUTO`` on every dimension seen to differ from the first (it takes 2.4 to 3.5 plain exports,
   and each signature it then serves about a tenth of one): torch decides which of them can stay symbolic,
   records the relations between them (a mask one longer than the cache) and their ranges, and specialises the
   rest;
3. for that signature and every later one, the symbolic graph **specialised** to the call's sizes: the inputs are
   checked against the export's constraints by torch's own check (``_check_input_constraints_for_graph``: the
   relations, the ranges, the dimensions it specialised), and against every guard the export's shape environment
   recorded (the forward's branches on sizes that are not ranges: ``T % 2 == 0``, ``T == 5``; what
   ``ExportedProgram.module()`` checks in its ``_guards_fn``), any false one refusing; every size the graph
   computes is folded to its value, every runtime assertion export left in the graph is evaluated (any false one
   refuses), and every value's shape, strides and offset are evaluated at those sizes (what propagating the inputs
   through the graph op by op gives, without running the ops' meta kernels). The result is the graph a fresh export at
   those sizes gives, but for the whole-dim slices a symbolic length keeps (``x[..., :n]`` with ``n`` the dim's
   length: a fresh export drops them; a small Llama's decode step keeps three), and capture treats it as usual.

A dimension the symbolic export kept static because it had not yet changed (the batch, when a second generate()
comes with another batch size) changes: the family makes one symbolic export more, with that dimension among the
symbolic ones, and serves from the newest program that holds; the older ones still serve their sizes (torch may
have specialised the new dimension anyway). A family makes such an export only when a dimension changes that none
of its exports had seen change, so it makes at most one per dimension.

Where anything refuses (the export with symbols fails, the constraints or a guard do not hold, the graph reads
sizes from data, an assertion is false), that signature is exported by itself, as without sharing: a size on the
other side of a branch takes the branch eager takes (and the model given as an ``ExportedProgram``'s module refuses
it there, as that module does). The
plans stay one per signature: only the export is shared.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autofuse.caches import Length
from autofuse.capture import autograd_reads, custom_functions_applied, lifted_input, with_forward
from autofuse.graph import SIZE_ASSERTS, draw_order, graph_module
from autofuse.quiet import symbolic_export_logs

#: Calls of one family known to be coming (:meth:`SizeFamilies.expecting`) from which a symbolic export pays.
SHARE_FROM = 5


class Unsuitable(Exception):
    """The symbolic export cannot serve these inputs; export them as before."""


@dataclass
class _Family:
    sizes: tuple                 # the first signature's sizes, leaf by leaf (None for a non-tensor leaf)
    exported: int = 1            # signatures exported by themselves so far
    changed: dict = field(default_factory=dict)     # leaf -> the dims seen to change
    programs: list = field(default_factory=list)    # the symbolic ExportedPrograms made, the newest first
    guard: Any = None            # what the programs assumed of the model's modules (``make_guard``)
    failed: bool = False         # its export failed: every signature of the family is exported by itself
    served: int = 0              # signatures specialised from it
    functions: set = field(default_factory=set)     # the custom autograd.Functions its traces applied, by name
    state: Any = None            # the autograd state its newest program was traced in (_autograd_state)
    widened: int = 0             # symbolic exports made again, with a dimension more that had changed


@dataclass
class SizeFamilies:
    """The families of one fused module (see the module docstring). ``export(model, args, kwargs, export_fn)``
    stands in for capture's export function ``export_fn``. ``make_guard(model)`` gives an object whose
    ``check(model)`` says why the model no longer is what a program captured (a module replaced, a plain attribute
    changed: capture bakes those in), or None; a program whose guard fails is dropped and its family starts over."""

    make_guard: Any = None
    families: dict = field(default_factory=dict)
    #: signatures of a family exported by themselves before the symbolic export (which takes 2.4 to 3.5 plain ones,
    #: and pays from about the sixth signature; :meth:`expecting` decides where the calls to come are known)
    plain_first: int = 2
    _window: Any = None          # (calls coming, families met) inside :meth:`expecting`

    @contextlib.contextmanager
    def expecting(self, calls):
        """While a caller that knows how many calls of one family are coming (``calls``: generate()'s decode steps)
        makes them. A symbolic export takes 2.4 to 3.5 plain ones (measured ad hoc on the decode steps of
        Llama-style models of 1, 4 and 8 layers), and every signature it serves about a tenth of one. With
        ``SHARE_FROM`` or more coming, a family called a second time inside this block makes it then (the decode
        steps' family at its second step), which saves the second plain export of the default order; a family met
        once inside it (the prefill's, whose second signature may be the next generate()'s) keeps the default. With
        fewer coming, none is made (each is exported by itself, cheaper than the symbolic export at the third). A
        dimension that changes where a program exists still widens it (the program serves later calls too)."""
        before = self._window
        self._window = None if calls is None else (calls, set())
        try:
            yield
        finally:
            self._window = before

    def _plain_first(self, key) -> float:
        """How many signatures of the family ``key`` are exported by themselves before its symbolic export, at this
        call (:meth:`expecting`); the family is counted as met in the block."""
        if self._window is None:
            return self.plain_first
        calls, met = self._window
        again = key in met
        met.add(key)
        return math.inf if calls < SHARE_FROM else 1 if again else self.plain_first

    @property
    def served(self) -> int:
        """Signatures specialised from a symbolic export, over the families held now."""
        return sum(f.served for f in self.families.values())

    def export(self, model, args, kwargs, export_fn):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        from autofuse.engine import autocast_state, state_spec
        # a symbolic export holds the parameters' dtypes and shapes (a model.half() later starts another family)
        key = (spec, model.training, autocast_state(), state_spec(model), tuple(_leaf_kind(x) for x in leaves))
        sizes = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else (int(x),) if type(x) is Length else None
                      for x in leaves)
        fam = self.families.get(key)
        plain_first = self._plain_first(key)
        if fam is not None and fam.guard is not None and fam.guard.check(model) is not None:
            fam = None                                  # the model changed since: start the family again
        if fam is None:
            fam = self.families[key] = _Family(sizes)
            return _traced(fam, export_fn)(model, args, kwargs)
        export_fn = _traced(fam, export_fn)
        if not fam.programs and not fam.failed:
            _widen(fam, sizes)
            if not fam.changed or fam.exported < plain_first:
                fam.exported += 1
                return export_fn(model, args, kwargs)
            program = self._symbolic(fam, model, args, kwargs, leaves, export_fn)
            if program is not None:
                return program                 # this signature's own export: the family exports each by itself
        if fam.programs and fam.functions and _autograd_state(model) != fam.state:
            # a custom autograd.Function is traced through without grad and kept whole with it: the programs,
            # traced in another autograd state, do not serve this call
            return export_fn(model, args, kwargs)
        if fam.programs:
            out = _serve(fam, leaves, spec, model)
            if out is None and _widen(fam, sizes):
                # a dimension the programs kept static changed (another batch size): one symbolic export more,
                # with that dimension among the symbolic ones; the programs before it still serve their sizes
                program = self._symbolic(fam, model, args, kwargs, leaves, export_fn, widening=True)
                if program is not None:
                    return program
                out = _serve(fam, leaves, spec, model)
            if out is not None:
                return out
        return export_fn(model, args, kwargs)

    def _symbolic(self, fam, model, args, kwargs, leaves, export_fn, widening=False):
        """One export with ``Dim.AUTO`` on the family's changed dims, added to ``fam.programs`` (None returned).
        Where it cannot serve, this signature's own export is returned instead, and a family with no program
        yet is marked ``failed``: it exports each signature by itself."""
        try:
            named = _named_arguments(model, kwargs)
            with symbolic_export_logs():
                program = export_fn(named, args, kwargs, dynamic_shapes=_dynamic_shapes(fam, leaves, named, args,
                                                                                         kwargs))
        except Exception:  # noqa: BLE001 - torch could not keep those sizes symbolic: export each signature
            fam.failed = not fam.programs
            return export_fn(model, args, kwargs)
        if fam.failed:                         # the forward read autograd state (_traced)
            return export_fn(model, args, kwargs)
        if not _symbolic_inputs(program) or _unbacked(program):
            fam.failed = not fam.programs      # nothing stayed symbolic, or sizes read from data: nothing to share
            return export_fn(model, args, kwargs) if _unbacked(program) else program
        fam.programs.insert(0, program)        # the newest first: it has the most symbolic dims
        fam.state = _autograd_state(model)
        fam.widened += widening
        if fam.guard is None and self.make_guard is not None:
            fam.guard = self.make_guard(model)
        return None


def _dynamic_shapes(fam, leaves, model, args, kwargs):
    """torch.export's ``dynamic_shapes`` for the call: ``Dim.AUTO`` on each changed dimension of a tensor, and on
    every lifted KV cache length (:class:`autofuse.caches.Length`) where one has changed (torch's ShapesCollection
    names tensors only: an int has no identity to name it by)."""
    from torch.export.dynamic_shapes import _combine_args, _tree_map_with_path
    dims = {id(leaves[i]): {d: torch.export.Dim.AUTO for d in ds} for i, ds in fam.changed.items()
            if isinstance(leaves[i], torch.Tensor)}
    lengths = any(type(leaves[i]) is Length for i in fam.changed)

    def spec(path, x):
        if type(x) is Length:
            return torch.export.Dim.AUTO if lengths else None
        return dims.get(id(x)) if isinstance(x, torch.Tensor) else None
    return _tree_map_with_path(spec, _combine_args(model, args, kwargs))


def _autograd_state(model) -> tuple:
    """What a traced forward's custom autograd.Functions depend on: the grad mode, and whether a parameter requires
    grad (capture keeps such a Function whole only where the call is differentiated)."""
    return torch.is_grad_enabled(), any(p.requires_grad for p in model.parameters())


def _traced(fam, export_fn):
    """``export_fn``, marking ``fam`` failed where the forward read autograd state while it was traced (a branch on
    ``tensor.requires_grad``, :func:`autofuse.capture.autograd_reads`): such a forward is exported at each
    signature, in that call's state, since a shared export would serve every call the branch its trace took. The
    custom autograd.Functions it applied are recorded for the captures the family serves."""
    def traced(*args, **kwargs):
        before, applied = autograd_reads(), len(custom_functions_applied())
        program = export_fn(*args, **kwargs)
        if autograd_reads() > before:
            fam.failed, fam.programs = True, []
        fam.functions.update(custom_functions_applied()[applied:])
        return program
    return traced


def _serve(fam, leaves, spec, model):
    """The first of the family's programs that serves ``leaves``, specialised to them; None if none does."""
    for program in fam.programs:
        try:
            if program.call_spec.in_spec != spec:     # the call's structure, as capture will flatten it
                raise Unsuitable("the export flattens the inputs in another order")
            out = specialise(program, leaves, model)
        except Unsuitable:
            continue
        fam.served += 1
        out.functions = tuple(sorted(fam.functions))
        return out
    return None


def _widen(fam, sizes) -> bool:
    """Add the dims in which ``sizes`` differ from the family's first signature to ``fam.changed``; whether any
    was new."""
    new = False
    for i, dims in _changed_dims(fam.sizes, sizes).items():
        before = set(fam.changed.get(i, ()))
        if not set(dims) <= before:
            fam.changed[i] = sorted(before | set(dims))
            new = True
    return new


def _named_arguments(model, kwargs):
    """``model`` with a forward whose signature names every keyword the call passes. torch 2.13's export with
    ``dynamic_shapes`` fails on a keyword that lands in the forward's ``**kwargs`` (transformers passes
    ``return_dict`` so): it lists the keyword both inside the ``**kwargs`` entry and beside it, and the dynamic
    shapes then match neither. The stand-in (:func:`autofuse.capture.with_forward`) calls the model's own forward."""
    import inspect

    sig = inspect.signature(model.forward)
    P = inspect.Parameter
    if not any(p.kind is P.VAR_KEYWORD for p in sig.parameters.values()) or all(k in sig.parameters for k in kwargs):
        return model
    params = [p for p in sig.parameters.values() if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    params += [P(k, P.KEYWORD_ONLY) for k in kwargs if k not in sig.parameters]
    own = model.forward

    def forward(*args, **kw):
        return own(*args, **kw)

    forward.__signature__ = inspect.Signature(params)
    return with_forward(model, forward)


def layout(x: torch.Tensor):
    """A tensor's layout as far as a plan depends on it: contiguous, or the order of its dims by stride (a
    transposed input gives transposed outputs, as eager's elementwise kernels follow their input's layout), with
    the order of the dense tensor eager lays out like it where the two differ (an expanded or sliced input:
    ``empty_like`` and the elementwise kernels order a stride-0 dim by position, and a dropout draws its mask in
    that order, so an input broadcast along its rows and a transposed one, whose strides sort alike, differ)."""
    if x.is_contiguous():
        return "contiguous"
    order = tuple(sorted((d for d in range(x.dim()) if x.shape[d] != 1), key=lambda d: -x.stride(d)))
    dense = draw_order(x)
    dense = "row-major" if dense is None else tuple(d for d in dense if x.shape[d] != 1)
    return order if dense == order else (order, dense)


def _leaf_kind(x):
    if type(x) is Length:
        return ("length",)                      # a size of the call (autofuse.caches.lengths_tied)
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, x.device.type, x.dim(), x.requires_grad, layout(x))
    return ("value", type(x), x if isinstance(x, (int, float, bool, str, type(None))) else id(x))


def _changed_dims(before, now) -> dict:
    return {i: [d for d, (a, b) in enumerate(zip(x, y)) if a != b]
            for i, (x, y) in enumerate(zip(before, now)) if x is not None and x != y}


def _user_placeholders(program) -> list:
    names = [s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    nodes = {n.name: n for n in program.graph_module.graph.nodes if n.op == "placeholder"}
    return [nodes[n] for n in names]


def _symbolic_inputs(program) -> bool:
    return any(isinstance(d, torch.SymInt) for n in _user_placeholders(program)
               for d in getattr(n.meta.get("val"), "shape", (n.meta.get("val"),)))


def _unbacked(program) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    for n in program.graph_module.graph.nodes:
        try:
            if free_unbacked_symbols(n.meta.get("val")):
                return True
        except Exception:  # noqa: BLE001 - a value torch cannot walk holds no symbol
            continue
    return False


def _bindings(program, leaves) -> dict:
    """Each size symbol's value for ``leaves``, after torch's own check of the export's input constraints."""
    from torch._export.utils import _check_input_constraints_for_graph
    placeholders = _user_placeholders(program)
    if len(placeholders) != len(leaves):
        raise Unsuitable("another number of inputs")
    try:
        _check_input_constraints_for_graph(placeholders, [((pytree.SequenceKey(i),), x) for i, x in enumerate(leaves)],
                                           program.range_constraints)
    except RuntimeError as e:
        raise Unsuitable(str(e)) from None
    except IndexError:      # torch 2.13 formats a later input's key path with (args, kwargs) in mind, and fails
        raise Unsuitable("an input's sizes break the export's constraints") from None
    values = {}
    for node, x in zip(placeholders, leaves):
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) and val.node.expr.is_Symbol:      # an int input kept symbolic
            values[val.node.expr] = int(x)
        for d, size in zip(getattr(val, "shape", ()), getattr(x, "shape", ())):
            if isinstance(d, torch.SymInt) and d.node.expr.is_Symbol:
                values[d.node.expr] = int(size)
    return values


def _shape_env(program):
    """The shape environment of ``program``'s symbolic sizes (that of its placeholders' values), or None."""
    for node in _user_placeholders(program):
        for d in getattr(node.meta.get("val"), "shape", ()):
            if isinstance(d, torch.SymInt):
                return d.node.shape_env
    return None


def _check_guards(program, values) -> None:
    """Raise :class:`Unsuitable` unless every guard the export recorded holds at the sizes ``values``. A forward
    that branches on a size (``if T % 2 == 0``, ``if T == 5``, a slice that would be one long) leaves a guard in
    the export's shape environment, not in its range constraints nor in its graph: ``ExportedProgram.module()``
    checks it (its ``_guards_fn``, from the same guards), ``_check_input_constraints_for_graph`` does not. A size
    that breaks one takes the other branch in eager, which the symbolic graph does not hold."""
    import sympy
    env = _shape_env(program)
    if env is None:
        return
    for guard in env.guards:
        expr = env.replace(guard.expr)          # a symbol the export later related to another: in its terms
        try:
            holds = sympy.sympify(expr.xreplace(values))
        except Exception as e:  # noqa: BLE001 - an expression sympy cannot evaluate at these sizes
            raise Unsuitable(f"the export's guard {guard.expr} cannot be evaluated: {type(e).__name__}") from None
        if holds.free_symbols:
            raise Unsuitable(f"the export's guard {guard.expr} is not determined by the inputs' sizes")
        if holds is not sympy.true:
            raise Unsuitable(f"the export's guard {guard.expr} does not hold at these sizes")


def _evaluate(sym, values):
    import sympy
    expr = sympy.sympify(sympy.sympify(sym.node.expr).xreplace(values))
    if expr.free_symbols:
        raise Unsuitable(f"the size {sym.node.expr} is not determined by the inputs' sizes")
    if isinstance(sym, torch.SymBool):
        return bool(expr)
    if isinstance(sym, torch.SymFloat):
        return float(expr)
    return int(expr)


def specialise(program, leaves, model) -> Any:
    """``program`` (an ExportedProgram with symbolic sizes) as the static program a fresh export at the sizes of
    ``leaves`` gives: the same signature and constants, a graph whose sizes are numbers (see the module
    docstring). Raises :class:`Unsuitable` where it cannot serve these inputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    values = _bindings(program, leaves)
    _check_guards(program, values)
    source = program.graph_module
    graph = fx.Graph()
    env: dict = {}
    out = graph.graph_copy(source.graph, env)
    graph.output(out)
    folded, inputs = {}, {}
    for node in list(graph.nodes):
        val = node.meta.get("val")
        if node.op == "call_function" and isinstance(val, (torch.SymInt, torch.SymBool, torch.SymFloat)):
            folded[node] = _evaluate(val, values)
        elif node.op == "placeholder" and isinstance(val, torch.SymInt):
            inputs[node] = _evaluate(val, values)      # an int input kept symbolic: its uses read the number
    for node in list(graph.nodes):
        if node.op != "placeholder" and node not in folded:
            node.args, node.kwargs = fx.map_arg((node.args, node.kwargs),
                                                lambda a: folded.get(a, inputs.get(a, a)))
    for node in reversed(list(graph.nodes)):
        # the size assertions: evaluated once the sizes are known, then removed
        if node.op == "call_function" and node.target in SIZE_ASSERTS:
            cond = node.args[0]
            if node.target is torch.ops.aten._assert_scalar.default and cond is not True:
                raise Unsuitable(f"an assertion of the export does not hold at these sizes: {node.args[1:]}")
            graph.erase_node(node)
    for node in reversed(list(folded)):      # a size computed from another: the later one goes first
        graph.erase_node(node)
    gm = graph_module(source, graph)
    # the inputs in the graph's order: the model's parameters, buffers and constants (its own tensors: their
    # requires_grad is what a fresh export sees), then the call's leaves
    user = iter(leaves)
    real = []
    for spec in program.graph_signature.input_specs:
        if spec.kind.name == "USER_INPUT":
            real.append(next(user))
            continue
        tensor = lifted_input(model, program, spec)
        if tensor is None:
            raise Unsuitable(f"an input of kind {spec.kind.name}")
        real.append(tensor)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # not through capture's torch-function modes (they watch the forward's reads; no forward runs here), whose Python
    # handler every fake tensor construction would otherwise pass through
    try:
        with torch._C.DisableTorchFunction():
            _values_at(gm, values, real, mode)
    except Unsuitable:
        raise
    except Exception as e:  # noqa: BLE001 - a size expression sympy cannot evaluate, a layout torch refuses
        raise Unsuitable(f"a value's metadata cannot be evaluated at these sizes: {type(e).__name__}: {e}") from None
    return _Specialised(program, gm)


def _values_at(gm, values, real, mode) -> None:
    """Each node's value in ``gm`` (a copy of the symbolic graph) at the sizes ``values``: the placeholders' from the
    real inputs ``real`` (an export's placeholders keep their inputs' requires_grad), every other tensor a fake one of
    its symbolic value's shape, strides and offset evaluated there, dtype and device, detached (as a propagation of
    fake tensors through the graph stores them). The same metadata as propagating the inputs op by op
    (tests/test_sizes.py compares the two node by node, torch's FakeTensorProp on the same graph), without running
    any op's meta kernel."""
    known: dict = {}        # each size expression evaluated once: a few recur across all of a graph's values

    def size(d):
        if not isinstance(d, torch.SymInt):
            return d
        if d.node.expr not in known:
            known[d.node.expr] = _evaluate(d, values)
        return known[d.node.expr]

    def at(v):
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return _evaluate(v, values)
        if not isinstance(v, torch.Tensor):
            return v
        shape, stride, offset = [size(d) for d in v.shape], [size(d) for d in v.stride()], size(v.storage_offset())
        with mode:
            if not offset:
                return torch.empty_strided(shape, stride, dtype=v.dtype, device=v.device)
            extent = offset + 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else offset
            return torch.empty(extent, dtype=v.dtype, device=v.device).as_strided(shape, stride, offset)

    inputs = iter(real)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            x = next(inputs)
            node.meta["val"] = mode.from_tensor(x) if isinstance(x, torch.Tensor) else \
                int(x) if type(x) is Length else x
        elif "val" in node.meta:
            node.meta["val"] = pytree.tree_map(at, node.meta["val"])


class _Specialised:
    """What capture reads of an ExportedProgram (its signature, constants, call spec and graph), with the graph
    specialised to one signature's sizes."""

    def __init__(self, program, graph_module):
        self.graph_signature = program.graph_signature
        self.constants = program.constants
        self.call_spec = program.call_spec
        self.graph_module = graph_module
        #: the custom autograd.Functions the family's traces applied (a served capture does not run the forward)
        self.functions = ()


__all__ = ["SizeFamilies", "Unsuitable", "specialise"]
