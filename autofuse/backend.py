"""``torch.compile(model, backend="autofuse")``: Dynamo hands over each graph it captures; autofuse fuses it.

    compiled = torch.compile(model, backend="autofuse")     # works without `import autofuse` (entry point)
    y = compiled(x)
    for r in autofuse.reports(compiled):                     # one FusionReport per graph Dynamo captured
        print(r.summary())

    be = autofuse.backend(target_device="ascend910b", optimization_level="O2")   # other settings
    compiled = torch.compile(model, backend=be)
    compiled(x)
    be.reports                                               # what this backend compiled, in order

**Discovery.** ``pyproject.toml`` declares ``autofuse = "autofuse.backend:autofuse_backend"`` in the
``torch_dynamo_backends`` entry-point group. torch 2.13 resolves a backend name it does not know by reading
that group with ``importlib.metadata.entry_points`` (``torch._dynamo.backends.registry``,
``_discover_entrypoint_backends``) and loads the entry point on first use, so an installed autofuse needs no
import. ``import autofuse`` also registers the name (a source checkout on ``PYTHONPATH`` has no entry point).

**Graph breaks.** Dynamo splits a forward where it cannot trace (``print``, ``.item()``, data-dependent
Python control flow) and calls the backend once per captured graph, and again when a guard fails (new
shapes). Each graph is fused on its own: its own capture, plan, verification and report; what runs between
graphs is plain Python and torch.

**Sizes that change.** When a graph's input sizes change between calls, Dynamo compiles it again as a dynamic
graph: the changed size becomes a symbol (a ``SymInt`` input, symbolic tensor sizes). autofuse plans at concrete
sizes (its tilings, prices and checks are per size), so such a graph's ``FusedModule`` plans at each size it meets
at run time, once per input signature, as ``fuse()`` does without example inputs; each plan has its report.

**Reports.** Each call records a :class:`CompiledGraph` (Dynamo's graph, the :class:`~autofuse.FusedModule`
built from it, its reports) on the backend object and against the callable ``torch.compile`` wrapped: the
model of an ``OptimizedModule`` or the compiled function. :func:`reports` and :func:`graphs` accept
``torch.compile``'s result, the original model or function, a backend, or a ``FusedModule``. The callable is
found by walking the Python stack at compile time for Dynamo's entry frame (an ``OptimizedModule`` call, or
``torch._dynamo.eval_frame``'s ``compile_wrapper`` for functions): these are torch internals, checked by
``tests/test_backend.py``; when they are not found the graphs are still on the backend object.

Library warnings torch raises against itself during capture are silenced at the call
(:mod:`autofuse.quiet`); everything else reaches the user.
"""
from __future__ import annotations

import math
import operator
import sys
import warnings
import weakref
from dataclasses import dataclass, field

import torch

from autofuse.grad_ops import CUSTOM_FUNCTION, is_grad_mode_call, register_custom_function, without_grad_mode_calls
from autofuse.quiet import torch_internal_warnings


@dataclass
class CompiledGraph:
    """One graph Dynamo captured and autofuse fused."""

    index: int                           # the order in which this backend compiled it
    graph_module: torch.fx.GraphModule   # Dynamo's graph (torch level), as handed to the backend
    fused: object                        # the FusedModule that runs it
    owner: str = ""                      # what it belongs to: the model's class or the function's name
    notes: list = field(default_factory=list)

    @property
    def reports(self) -> list:
        """One report per input signature this graph was planned for (usually one)."""
        return [p.report for p in self.fused.plans.values()]


_BY_CALLABLE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _compiled_callable():
    """The model or function whose ``torch.compile`` wrapper is compiling right now (see module docstring)."""
    from torch._dynamo.eval_frame import OptimizedModule
    f = sys._getframe(2)
    while f is not None:
        owner = f.f_locals.get("self")
        if isinstance(owner, OptimizedModule):
            return owner._orig_mod
        if f.f_code.co_name == "compile_wrapper" and f.f_code.co_filename.endswith("eval_frame.py"):
            fn = f.f_locals.get("fn")
            if isinstance(getattr(fn, "__self__", None), torch.nn.Module):    # a module's bound __call__
                return fn.__self__
            if callable(fn) and not getattr(fn, "__module__", "").startswith("torch."):   # the user's function
                return fn
        f = f.f_back
    return None


def _symbolic(inputs) -> bool:
    """Whether Dynamo's example inputs hold symbols (its dynamic shapes: a ``SymInt`` input, a symbolic size)."""
    sym = (torch.SymInt, torch.SymFloat, torch.SymBool)
    return any(isinstance(x, sym) or isinstance(x, torch.Tensor) and any(isinstance(d, sym) for d in x.shape)
               for x in inputs)


class Backend:
    """A Dynamo backend with fixed engine settings (see :func:`autofuse.AutoFusionEngine.fuse`)."""

    def __init__(self, target_device="ascend910", optimization_level="O3", memory_budget=None, verify=True,
                 **engine_options):
        from autofuse.engine import fuse_options, unknown_options
        known = fuse_options()
        unknown = [k for k in engine_options if k not in known]
        if unknown:                     # refused here, not at the first compile inside Dynamo
            raise TypeError(unknown_options("autofuse.backend", unknown))
        self.settings = dict(target_device=target_device, optimization_level=optimization_level,
                             memory_budget=memory_budget, verify=verify, **engine_options)
        self.graphs: list[CompiledGraph] = []
        self._warned: set = set()       # the torch.compile modes and the numpy draws warned of

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, mode=None, options=None):
        from autofuse.capture import CaptureError, mark_grad_blocks
        from autofuse.engine import AutoFusionEngine, InputDtypeError
        settings = self._settings(mode, options)
        owner = _compiled_callable()
        example = tuple(example_inputs)
        # Dynamo's GraphModule is in training mode whatever the model's mode was (a new module's default); the graph
        # holds the model's semantics, so its mode is the compiled module's, or for a function whether an op of the
        # graph runs in training mode (only the flag is set: the graph's submodules are not the user's to change)
        from autofuse.fused_vector import training_graph
        gm.training = owner.training if isinstance(owner, torch.nn.Module) else training_graph(gm.graph)
        if _inline_derivative_functions(gm):    # before the grad blocks: a Function's own no_grad goes with it
            gm.recompile()
        mark_grad_blocks(gm)            # the forward's no_grad blocks stop the gradient in the captured graph too
        draws = [d for d in _numpy_draws(gm) if ("numpy draw", d) not in self._warned]
        if draws:
            # Dynamo's doing, whatever the backend: said once per draw, though each recompilation hands it over again
            self._warned.update(("numpy draw", d) for d in draws)
            warnings.warn(_numpy_draw_warning(draws), stacklevel=2)
        if _keep_custom_functions(gm):      # the rest: each one op with its own backward
            gm.recompile()
        where = _custom_function_applied(gm)
        if where:
            # a capture would keep the Function's forward and lose its backward (autograd would differentiate the
            # forward): this graph runs as Dynamo gave it, its own backward included
            warnings.warn(f"autofuse: a graph that applies a custom autograd.Function with grad ({where}) runs "
                          f"unfused, as Dynamo captured it: a capture would keep only its forward. Under "
                          f"torch.no_grad() it fuses.", stacklevel=2)
            return gm
        _composite_fast_paths(gm)                   # torch's fused encoder layers, as ops a pattern sees
        floats = _wrapped_floats(gm, example)       # from here on, gm takes those inputs as Python floats
        passed, n_out = _passed_through(gm)         # and returns only what it computes

        def plain(args):
            return tuple(x.item() if i in floats else x for i, x in enumerate(args)) if floats else args

        def whole(out, args):
            # the graph's outputs, with the inputs it hands back as they were (sizes Dynamo returns) in their places
            if not passed:
                return out
            computed = iter(out)
            return tuple(args[passed[k]] if k in passed else next(computed) for k in range(n_out))

        def unfused(*args):
            args = plain(args)
            return whole(gm(*args), args)

        example = plain(example)
        wide = _host_arrays(example, owner)
        with torch_internal_warnings():
            # a graph Dynamo made dynamic (a size that changed between calls is now a symbol, passed as an input) is
            # planned per concrete signature at run time, as fuse() plans without example inputs
            try:
                fused = AutoFusionEngine.fuse(gm, None if _symbolic(example) else example, **settings)
            except CaptureError as e:
                _run_as_captured(e)
                return unfused
            except InputDtypeError as e:
                if e.leaf not in wide:      # the model's own float64 parameters: fuse()'s refusal stands
                    raise
                warnings.warn(_wide_input_warning(wide, e), stacklevel=2)
                return unfused
        name = type(owner).__name__ if isinstance(owner, torch.nn.Module) else getattr(owner, "__name__", "")
        record = CompiledGraph(len(self.graphs), gm, fused, name)
        self.graphs.append(record)
        if owner is not None:
            try:
                _BY_CALLABLE.setdefault(owner, []).append(record)
            except TypeError:       # not weak-referenceable (a builtin): the backend object still has it
                pass

        from autofuse.engine import _signature
        failed = set()      # the input signatures whose capture failed: they run unfused, with no new attempt

        def run(*args):
            args = plain(args)
            if failed and _signature(args, {}) in failed:
                return whole(gm(*args), args)
            with torch_internal_warnings():      # a new input signature captures again
                try:
                    return whole(fused(*args), args)
                except CaptureError as e:        # planned at this call's sizes (a graph Dynamo made dynamic)
                    # only this signature runs unfused from now on: another one (other sizes, another int) is
                    # captured afresh, once, as a signature that fused is planned once
                    failed.add(_signature(args, {}))
                    _run_as_captured(e)
                except InputDtypeError as e:     # a float64 input this graph computes with, at this signature
                    wide_now = _host_arrays(args, owner)
                    if e.leaf not in wide_now:
                        raise
                    failed.add(_signature(args, {}))
                    warnings.warn(_wide_input_warning(wide_now, e), stacklevel=2)
            return whole(gm(*args), args)
        return run

    def _settings(self, mode, options) -> dict:
        """This backend's engine settings with ``torch.compile``'s ``options`` over them (the names
        :func:`autofuse.AutoFusionEngine.fuse` takes: ``{"target_device": "ascend910b", "optimization_level":
        "O2"}``). ``mode`` names Inductor's schedules (CUDA graphs, autotuning), which have no meaning here: it is
        accepted, with a warning that says where the level is set."""
        from autofuse.engine import fuse_options, unknown_options
        if mode is not None and mode != "default" and mode not in self._warned:
            self._warned.add(mode)
            warnings.warn(f"autofuse: torch.compile's mode={mode!r} is Inductor's and has no effect on autofuse; set "
                          f"the optimization level with options={{'optimization_level': 'O2'}} (or "
                          f"autofuse.backend(optimization_level=...))", stacklevel=3)
        options = dict(options or {})
        unknown = sorted(set(options) - set(fuse_options()))
        if unknown:         # the message fuse() and autofuse.backend() give, each name with the option it is closest to
            raise TypeError(unknown_options("autofuse (torch.compile's options=)", unknown))
        return {**self.settings, **options}

    @property
    def fused_modules(self) -> list:
        return [g.fused for g in self.graphs]

    @property
    def reports(self) -> list:
        return [r for g in self.graphs for r in g.reports]

    def __repr__(self):
        return f"autofuse.backend({', '.join(f'{k}={v!r}' for k, v in self.settings.items())})"


def _wrapped_floats(gm: torch.fx.GraphModule, example) -> set:
    """The inputs that are Python floats Dynamo passes as 0-d tensors, read with ``.item()`` (with ``dynamic=True``
    a norm's ``eps`` comes so, to spare a recompile when it changes): the graph is rewritten to take the float itself,
    and each call passes it as one (``run``), so that a plan is made per value, as for a float argument of
    ``fuse()``. Their positions among the inputs. Read as a tensor value, the capture could not trace them."""
    floats = set()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, (n, x) in enumerate(zip(placeholders, example)):
        reads = list(n.users)
        wrapped = getattr(n.meta.get("grapharg"), "pass_arg_as_tensor", False)     # not a tensor of the user's
        if wrapped and isinstance(x, torch.Tensor) and x.dim() == 0 and x.is_floating_point() and reads \
                and all(u.op == "call_method" and u.target == "item" and len(u.args) == 1 for u in reads):
            for u in reads:
                u.replace_all_uses_with(n)
                gm.graph.erase_node(u)
            floats.add(i)
    if floats:
        gm.recompile()
    return floats


def _passed_through(gm: torch.fx.GraphModule) -> tuple[dict, int]:
    """Outputs of a Dynamo graph that are inputs handed back unchanged and are no tensors (before a graph break
    Dynamo returns the size symbols it takes: ``return (s77, s27, h)``), which torch.export cannot take as
    outputs: the graph is rewritten to return the rest, and the caller puts them back (``whole``). Output
    position -> input position, and how many outputs the graph had."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    values = out.args[0]
    if not isinstance(values, (tuple, list)):
        return {}, 1
    position = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    passed = {k: position[v] for k, v in enumerate(values) if isinstance(v, torch.fx.Node) and v in position
              and not isinstance(v.meta.get("example_value"), torch.Tensor)}
    if passed:
        out.args = (tuple(v for k, v in enumerate(values) if k not in passed),)
        gm.recompile()
    return passed, len(values)


def encoder_layer(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu, norm_first,
                  eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1, ffn_weight_2,
                  ffn_bias_2, mask=None, mask_type=None):
    """``torch._transformer_encoder_layer_fwd`` (the fast path Dynamo captures for ``nn.TransformerEncoderLayer`` in
    eval without grad: one opaque kernel) as the torch ops its CPU kernel computes, which a capture sees into:
    q scaled by ``1/sqrt(head_dim)`` before ``q·kᵀ``; a mask (``merge_masks``'s: type 1 a ``[B, S]`` padding mask,
    else ``[S, S]`` or ``[B, H, S, S]``) masks where it is nonzero (the kernel casts a float mask to bool), a row with
    every key masked gives NaN as the kernel's does; ``use_gelu`` selects exact GELU over ReLU."""
    F = torch.nn.functional
    b, t, _ = src.shape
    heads, dim = num_heads, embed_dim // num_heads

    def attention(x):
        q, k, v = F.linear(x, qkv_weight, qkv_bias).view(b, t, 3, heads, dim).permute(2, 0, 3, 1, 4)
        scores = (q * (1.0 / math.sqrt(dim))) @ k.transpose(-2, -1)
        if mask is None:
            probs = scores.softmax(-1)
        else:
            masked = mask if mask.dtype == torch.bool else mask != 0
            masked = masked.view(b, 1, 1, t) if mask_type == 1 else masked.view(1, 1, t, t) if masked.dim() == 2 \
                else masked
            probs = scores.masked_fill(masked, float("-inf")).softmax(-1)
        out = (probs @ v).transpose(1, 2).reshape(b, t, embed_dim)
        return F.linear(out, proj_weight, proj_bias)

    def ffn(x):
        hidden = F.linear(x, ffn_weight_1, ffn_bias_1)
        return F.linear(F.gelu(hidden) if use_gelu else F.relu(hidden), ffn_weight_2, ffn_bias_2)

    def norm(x, weight, bias):
        return F.layer_norm(x, (embed_dim,), weight, bias, eps)

    if norm_first:
        x = src + attention(norm(src, norm_weight_1, norm_bias_1))
        return x + ffn(norm(x, norm_weight_2, norm_bias_2))
    x = norm(src + attention(src), norm_weight_1, norm_bias_1)
    return norm(x + ffn(x), norm_weight_2, norm_bias_2)


def _composite_fast_paths(gm) -> int:
    """Dynamo's calls of torch's encoder-layer fast path replaced by :func:`encoder_layer`, in place; how many."""
    hits = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch._transformer_encoder_layer_fwd]
    for n in hits:
        n.target = encoder_layer
    if hits:
        gm.recompile()
    return len(hits)


def _run_as_captured(error) -> None:
    """A graph whose capture fails runs as Dynamo gave it, unfused (a compiled model keeps running, as eager)."""
    reason = str(error).strip().replace("\n", " ")
    warnings.warn(f"autofuse: a graph Dynamo captured runs unfused, as Dynamo gave it: it could not be captured for "
                  f"fusion ({reason})", stacklevel=3)


def _host_arrays(example, owner) -> list:
    """The inputs of a Dynamo graph (their positions) that are tensors of a float dtype the target does not compute in
    (float64: numpy's) and not the compiled module's parameters or buffers (Dynamo hands those over as inputs; a
    float64 model is fuse()'s to refuse, with its cast hint). fuse() accepts them where the graph casts them into a
    compute dtype before computing with them."""
    from autofuse.engine import _bad_dtype
    state = {id(t) for t in (*owner.parameters(), *owner.buffers())} if isinstance(owner, torch.nn.Module) else set()
    return [i for i, x in enumerate(example) if _bad_dtype(x) and x.dim() > 0 and id(x) not in state]


def _wide_input_warning(wide: list, error) -> str:
    """Why a graph with inputs ``wide`` (:func:`_host_arrays`) runs unfused: ``error``, fuse()'s refusal, names the
    op that computes with one of them."""
    said = f" ({error.read})" if error.read else ""
    return (f"autofuse: a graph Dynamo captured runs unfused, as Dynamo gave it: its input(s) "
            f"{', '.join(map(str, wide))} hold a dtype the NPU target does not compute in (float16, bfloat16 and "
            f"float32 only), are not the model's parameters or buffers, and the graph computes with input "
            f"{error.leaf} in it, not only casting it first{said}: a numpy array the forward made, passed on at a "
            f"graph break (np.random's draws with torch._dynamo.config.use_numpy_random_stream = True), or an input "
            f"of that dtype. Cast it in the forward (torch.from_numpy(a).float(), x.to(self.weight.dtype)) for the "
            f"graph to fuse")


def _numpy_draws(gm: torch.fx.GraphModule) -> list[str]:
    """The forward's draws from numpy's global generator that Dynamo traced into ``gm`` (``np.random.rand at
    file:line: code``, one per call site). Dynamo traces numpy through ``torch._numpy``; with
    ``torch._dynamo.config.use_numpy_random_stream`` False (its default) a call of an ``np.random`` function becomes
    a node that calls ``torch._numpy.random``'s function, which draws from torch's generator; with the flag set
    Dynamo breaks the graph there instead and numpy draws, so no such node is made."""
    try:
        from torch._dynamo.utils import numpy_to_tensor_wrapper
    except ImportError:         # pragma: no cover - a torch that does not trace numpy so
        return []
    from autofuse.capture import _stack_line
    draws = []
    for n in gm.graph.nodes:
        f = getattr(n.target, "f", None)
        if n.op == "call_function" and isinstance(n.target, numpy_to_tensor_wrapper) and \
                getattr(f, "__module__", "") == "torch._numpy.random":
            where = _stack_line(n.meta.get("stack_trace") or "")
            draws.append(f"np.random.{f.__name__}{f' at {where}' if where else ''}")
    return list(dict.fromkeys(draws))


def _numpy_draw_warning(draws: list) -> str:
    """What a graph holding ``draws`` (:func:`_numpy_draws`) computes, and what makes it eager's."""
    return (f"autofuse: the forward draws from numpy's global random generator ({'; '.join(draws)}), and Dynamo "
            f"traced {'that draw as a draw' if len(draws) == 1 else 'those draws as draws'} from torch's generator "
            f"(torch._dynamo.config.use_numpy_random_stream is False, its default; any torch.compile backend gets "
            f"such a graph): the compiled model draws other numbers than eager's at every call (transformers' "
            f"SpecAugment masks in training, for one) and moves torch's generator where eager moves numpy's. To "
            f"compute what eager computes, set torch._dynamo.config.use_numpy_random_stream = True before the first "
            f"call (Dynamo then breaks the graph at each such draw and numpy makes it), or draw the values outside "
            f"the forward and pass them in (Wav2Vec2Model and its kin take mask_time_indices=), or set their "
            f"probabilities to 0 (mask_time_prob, mask_feature_prob)")


def _custom_function_applied(gm) -> str | None:
    """Where a Dynamo graph applies a custom ``autograd.Function`` with grad (one ``autograd_function_apply``
    node holding its forward and backward): the user's line, or None."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "__name__", "") == "autograd_function_apply":
            return _user_line(n)
    return None


def _user_line(n) -> str:
    """The user's line a Dynamo node comes from (the last frame of its stack trace), or the node's name."""
    lines = [ln.strip() for ln in (n.meta.get("stack_trace") or "").splitlines()
             if ln.strip() and set(ln.strip()) - set("^~")]
    files = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
    return f"{lines[files[-1]]}: {' '.join(lines[files[-1] + 1:])}" if files else n.name


def _inline_derivative_functions(gm) -> int:
    """Each custom ``autograd.Function`` a Dynamo graph applies with grad (an ``autograd_function_apply`` node: its
    forward and backward as two graphs) whose backward gives what autograd finds through its forward, on random
    inputs of the node's shapes (BLOOM's GeLU), is replaced by its forward's ops, which the capture differentiates
    as ``fuse()``'s capture does such a Function's (the rule of :func:`autofuse.capture.gradients_agree`). A
    Function that marks an output dirty, whose forward reads an attribute, or whose backward differs (a gradient
    reversal) stays, and :func:`_custom_function_applied` finds it. Returns how many were inlined."""
    inlined = 0
    for n, fwd, bwd in _function_applications(gm):
        if any(b.op == "get_attr" for b in fwd.graph.nodes) or not _backward_is_bodys_derivative(fwd, bwd, n):
            continue
        # the forward body's ops in the node's place, its own grad-mode calls left out (its output: the Function's
        # outputs, then what it saves for the backward)
        env = dict(zip((p for p in fwd.graph.nodes if p.op == "placeholder"), n.args[2:]))
        with gm.graph.inserting_before(n):
            for b in fwd.graph.nodes:
                if b.op not in ("placeholder", "output") and not is_grad_mode_call(b):
                    env[b] = gm.graph.node_copy(b, lambda x: env[x])
        results = fwd.graph.output_node().args[0][0]
        results = results if isinstance(results, (tuple, list)) else (results,)
        for u in list(n.users):
            u.replace_all_uses_with(env[results[u.args[1]]])
            gm.graph.erase_node(u)
        gm.graph.erase_node(n)
        inlined += 1
    if inlined:
        gm.graph.eliminate_dead_code()
    return inlined


def _function_applications(gm):
    """``(node, forward graph, backward graph)`` for each ``autograd_function_apply`` node of a Dynamo graph whose
    Function marks no output dirty and whose outputs are read by index only (what the two passes below can
    replace); a list, made before they change the graph."""
    found = []
    for n in gm.graph.nodes:
        if not (n.op == "call_function" and getattr(n.target, "__name__", "") == "autograd_function_apply"):
            continue
        fwd, bwd = (getattr(gm, a.target, None) if isinstance(a, torch.fx.Node) and a.op == "get_attr" else None
                    for a in n.args[:2])
        if isinstance(fwd, torch.fx.GraphModule) and isinstance(bwd, torch.fx.GraphModule) and \
                not n.kwargs.get("dirty_idx") and \
                all(u.op == "call_function" and u.target is operator.getitem for u in n.users):
            found.append((n, fwd, bwd))
    return found


def _keep_custom_functions(gm) -> int:
    """Each custom ``autograd.Function`` a Dynamo graph applies with grad that :func:`_inline_derivative_functions`
    left (its backward is not its forward's derivative: a gradient reversal, a straight-through estimator) becomes
    one ``autofuse_grad::custom_function`` op running its forward graph, whose gradient is its backward graph's:
    the capture keeps it whole, as an op the planner has no kernel for, and the graph fuses around it. A Function
    that marks an output dirty, or takes anything but tensors and sizes or gives anything but tensors, stays
    (:func:`_custom_function_applied`).
    Returns how many were replaced."""
    kept = 0
    for n, fwd, bwd in _function_applications(gm):
        args = n.args[2:]
        examples = [a.meta.get("example_value") if isinstance(a, torch.fx.Node) else a for a in args]
        is_size = [isinstance(e, (int, torch.SymInt)) and not isinstance(e, bool) for e in examples]
        if not all(size or isinstance(e, torch.Tensor) and isinstance(a, torch.fx.Node)
                   for a, e, size in zip(args, examples, is_size)):
            continue
        outs = n.meta.get("example_value")
        if not all(isinstance(o, torch.Tensor) for o in (outs if isinstance(outs, (tuple, list)) else (outs,))):
            continue
        key = register_custom_function(fwd, bwd, is_size, n.kwargs.get("non_differentiable_idx") or (),
                                       _user_line(n))
        with gm.graph.inserting_before(n):
            op = gm.graph.call_function(CUSTOM_FUNCTION, ([a for a, size in zip(args, is_size) if not size],
                                                          [a for a, size in zip(args, is_size) if size], key))
        op.meta.update({k: v for k, v in n.meta.items() if k != "example_value"})
        n.replace_all_uses_with(op)
        gm.graph.erase_node(n)
        kept += 1
    if kept:
        gm.graph.eliminate_dead_code()
    return kept


def _hinted(e):
    """An example value at the compiling call's sizes: a tensor's shape and dtype (``capture._TensorArg``), a size
    as the int it is there; None where a symbolic size has no such value."""
    from autofuse.capture import _TensorArg

    def size(d):
        return d if isinstance(d, int) else getattr(d.node, "hint", None) if isinstance(d, torch.SymInt) else None
    if isinstance(e, torch.Tensor):
        shape = tuple(size(d) for d in e.shape)
        return None if None in shape else _TensorArg(shape, e.dtype)
    return size(e) if isinstance(e, torch.SymInt) else e


def _backward_is_bodys_derivative(fwd, bwd, n) -> bool:
    """Whether ``bwd`` gives, for random inputs of ``n``'s shapes and random output gradients, what autograd finds
    through ``fwd``'s ops (its own grad-mode calls left out); 16-bit inputs in fp32, as :mod:`autofuse.capture`
    checks a Function ``fuse()`` captures. False where the shapes are not known or the bodies do not run."""
    from autofuse.capture import _TensorArg, check_argument, gradients_agree
    examples = [a.meta.get("example_value") if isinstance(a, torch.fx.Node) else a for a in n.args[2:]]
    if any(isinstance(e, torch.fx.Node) or e is None for e in examples):
        return False
    # a graph Dynamo made dynamic passes the Function symbolic sizes: checked at the sizes of the call compiling it
    examples = [_hinted(e) for e in examples]
    tensors = [e for e in examples if isinstance(e, _TensorArg)]
    if any(e is None for e in examples) or sum(math.prod(e.shape) for e in tensors) > 1 << 20:
        return False                    # no sizes known, or large: not checked here, so not known to be harmless
    plain = without_grad_mode_calls(fwd)
    skip = set(n.kwargs.get("non_differentiable_idx") or ())
    g = torch.Generator().manual_seed(0)
    try:
        with torch.random.fork_rng(), torch.enable_grad():
            args = [check_argument(e, g) for e in examples]
            outs, saved = plain(*args)
            outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
            g2 = torch.Generator().manual_seed(1)
            gouts = [torch.randn(o.shape, generator=g2).to(o.dtype) if isinstance(o, torch.Tensor) and
                     o.dtype.is_floating_point else None for o in outs]
            ins = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            pairs = [(o, go) for i, (o, go) in enumerate(zip(outs, gouts))
                     if i not in skip and go is not None and o.requires_grad]
            derivative = torch.autograd.grad([o for o, _ in pairs], ins, [go for _, go in pairs],
                                             allow_unused=True) if pairs else (None,) * len(ins)
            # the backward given what the forward saved (the same run's values, as the Function's backward reads
            # them: without their history)
            saved = [x.detach() if isinstance(x, torch.Tensor) else x for x in saved]
            with torch.no_grad():
                given = bwd(*[go if go is not None and i not in skip else torch.zeros_like(o)
                              for i, (o, go) in enumerate(zip(outs, gouts))], *saved)
    except Exception:  # noqa: BLE001 - a Function whose bodies cannot be run so is not known to be harmless
        return False
    given = tuple(given) if isinstance(given, (tuple, list)) else (given,)
    if len(given) < len(args):
        return False
    own = [x for a, x in zip(args, given) if isinstance(a, torch.Tensor) and a.requires_grad]
    return gradients_agree(own, list(derivative))


def backend(target_device="ascend910", optimization_level="O3", memory_budget=None, verify=True,
            **engine_options) -> Backend:
    """A Dynamo backend with the given engine settings: ``torch.compile(model, backend=autofuse.backend(...))``."""
    return Backend(target_device, optimization_level, memory_budget, verify, **engine_options)


#: What ``backend="autofuse"`` resolves to (the entry point and ``import autofuse`` register this object).
autofuse_backend = Backend()


def graphs(obj) -> list[CompiledGraph]:
    """Every graph compiled for ``obj``: ``torch.compile``'s result, the model or function it wrapped (a model's
    ``forward`` replaced by its compiled form gives the model's), or a :class:`Backend`, in compile order."""
    if isinstance(obj, Backend):
        return list(obj.graphs)
    target = obj
    for attr in ("_orig_mod", "_torchdynamo_orig_callable"):     # an OptimizedModule, a compiled function
        inner = getattr(obj, attr, None)
        if inner is not None:
            target = inner
            break
    if isinstance(getattr(target, "__self__", None), torch.nn.Module):    # a module's (compiled) bound method
        target = target.__self__
    try:
        return list(_BY_CALLABLE.get(target, ()))
    except TypeError:
        return []


def reports(obj) -> list:
    """Every :class:`~autofuse.FusionReport` for ``obj`` (see :func:`graphs`; a ``FusedModule`` gives its own
    plans' reports). Empty until the compiled object has run once: Dynamo compiles at the first call."""
    from autofuse.engine import FusedModule
    if isinstance(obj, FusedModule):
        return [p.report for p in obj.plans.values()]
    return [r for g in graphs(obj) for r in g.reports]


def _register():
    try:
        from torch._dynamo import register_backend
        from torch._dynamo.backends.registry import _BACKENDS
    except ImportError:          # pragma: no cover - torch without Dynamo
        return
    # When Dynamo found the entry point first, it registers the loaded object itself (registering here too
    # would be a duplicate); otherwise (a source checkout, or autofuse imported before any lookup) register.
    if "autofuse" not in _BACKENDS:
        register_backend(name="autofuse")(autofuse_backend)


_register()
