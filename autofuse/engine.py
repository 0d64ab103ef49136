"""The engine: capture → canonicalize → match → plan (price, choose, verify) → rewrite.

    fused = AutoFusionEngine.fuse(model, example_inputs, target_device="ascend910", optimization_level="O3",
                                  memory_budget="16GB")
    y = fused(*inputs)              # fused attention blocks run on the NPU simulator, the rest in torch
    print(fused.report.summary())   # what was fused, what was not and why, with the numbers
    fused.simulate(*inputs)         # the whole graph on the simulator: cycles per node, peak memory

Without example inputs the engine plans at the first call, and again for each new input signature
(shapes, dtypes and non-tensor arguments). The user's model is never modified: capture leaves it as it
was, and the fused module's graph reads the model's own parameter tensors (shared, not copied).

The fused module computes forward passes only (the fused op has no backward) with eval-mode semantics
(capture switches dropout off). Models and inputs must be float16, bfloat16 or float32 (integer inputs
such as token ids are fine): the NPU has no float64 unit, and ``fuse`` says so naming the tensor.
"""
from __future__ import annotations

import json
import time

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autofuse import memory
from autofuse import ops as _ops  # noqa: F401  (registers torch.ops.autofuse.*)
from autofuse import verify as _verify
from autofuse.canonicalize import canonicalize, evaluate_constant
from autofuse.capture import capture
from autofuse.decision import FusionReport
from autofuse.match import families
from autofuse.plan import parse_level, parse_memory_budget, plan
from autofuse.rewrite import rewrite
from cost_model.devices import get_device


def _is_meta(leaves) -> bool:
    return any(isinstance(x, torch.Tensor) and x.device.type == "meta" for x in leaves)


def _signature(args, kwargs):
    leaves, spec = pytree.tree_flatten((args, kwargs))
    sig = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            sig.append(("T", tuple(x.shape), x.dtype, x.device.type))
        else:
            try:
                hash(x)
                sig.append(("V", x))
            except TypeError:
                sig.append(("V", repr(x)))
    return (spec, tuple(sig))


def all_candidates(gm: fx.GraphModule) -> list:
    """Every match of every family, overlaps included: choosing among them is the planner's job."""
    out = []
    for find in families().values():
        out.extend(find(gm))
    return out


class _AllKept(Exception):
    pass


class _Values(fx.Interpreter):
    """Runs the graph and keeps the values of the nodes asked for; stops as soon as it has them all."""

    def __init__(self, gm, wanted):
        super().__init__(gm)
        self.wanted, self.kept = set(wanted), {}

    def run_node(self, n):
        r = super().run_node(n)
        if n.name in self.wanted:
            self.kept[n.name] = r
            if len(self.kept) == len(self.wanted):
                raise _AllKept
        return r

    def values(self, *args) -> dict:
        try:
            with torch.no_grad():
                self.run(*args)
        except _AllKept:
            pass
        return self.kept


class Plan:
    """One input signature's compiled graph, with its report."""

    def __init__(self, captured, graph_module, report, canonical):
        self.captured = captured
        self.graph_module = graph_module
        self.report = report
        self.canonical = canonical

    def __call__(self, *args, **kwargs):
        leaves = self.captured.flatten_inputs(*args, **kwargs)
        out = self.graph_module(*leaves)
        return self.captured.unflatten_outputs(out if isinstance(out, (tuple, list)) else (out,))


FUSED_OP = torch.ops.autofuse.flash_attention.default


def _set_op_kwargs(gm: fx.GraphModule, kwargs_by_anchor: dict) -> fx.GraphModule:
    """Give each fused-op call its target device and tiling (rewrite tags each call with its Match)."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is FUSED_OP:
            match = n.meta.get("autofuse_match")
            extra = kwargs_by_anchor.get(match.anchor if match is not None else None, {})
            n.kwargs = {**n.kwargs, **extra}
    gm.recompile()
    return gm


def _op_kwargs(device: str, cand, level: str) -> dict:
    tiling = cand.fused.tiling if level == "O3" else {}
    return {"device": device, "tiling": json.dumps(tiling, sort_keys=True) if tiling else ""}


def compile_plan(model, args, kwargs, device, level, budget, route="auto", verify=True) -> Plan:
    """Capture ``model`` on ``(args, kwargs)`` and build its fused plan (see the module docstring)."""
    _check_input_dtypes(args, kwargs, device)
    t0 = time.perf_counter()
    captured = capture(model, args, kwargs, route=route)
    t1 = time.perf_counter()
    gm = canonicalize(captured.graph_module)
    t2 = time.perf_counter()
    cands = all_candidates(gm)
    t3 = time.perf_counter()
    leaves = pytree.tree_leaves((args, kwargs))
    checker = _Verifier(gm, cands, leaves, device, level)
    applied, decisions, priced = plan(gm, cands, device, level, budget, checker if verify else None)
    t4 = time.perf_counter()
    by_anchor = {c.match.anchor: _op_kwargs(device, c, level) for c in priced}
    fused = _set_op_kwargs(rewrite(gm, applied, FUSED_OP), by_anchor)
    t5 = time.perf_counter()
    workspace = {c.match.anchor: c.fused.workspace for c in priced}

    def kernel_workspace(n):
        match = n.meta.get("autofuse_match") if n.op == "call_function" and n.target is FUSED_OP else None
        return workspace.get(match.anchor, 0) if match is not None else 0

    report = FusionReport(device=device, optimization_level=level, memory_budget=budget, decisions=decisions,
                          peak_memory_unfused=memory.peak_bytes(gm),
                          peak_memory_fused=memory.peak_bytes(fused, kernel_workspace),
                          nodes_before=len(gm.graph.nodes), nodes_after=len(fused.graph.nodes),
                          capture_route=captured.route,
                          timings={"capture_s": t1 - t0, "canonicalize_s": t2 - t1, "match_s": t3 - t2,
                                   "plan_s": t4 - t3, "rewrite_s": t5 - t4})
    if budget is not None and report.peak_memory_fused > budget:
        report.warnings.append(f"the fused graph's peak activation memory {report.peak_memory_fused:,} B exceeds "
                               f"the budget {budget:,} B; no remaining candidate lowers it")
    return Plan(captured, fused, report, gm)


class _Verifier:
    """``verify(match, candidate)`` for the planner (see :mod:`autofuse.verify`).

    Identical blocks are verified once: blocks with the same structure (ops, arguments, shapes, dtypes,
    constants), the same kernel parameters and tiling run the same kernel code on the same shapes, so the
    first one's verdict holds for the rest. With real example inputs that first block is checked on its
    real input values (computed by one eager run of the graph, only when a block needs them); on meta
    inputs, on random values of the recorded shapes.
    """

    def __init__(self, gm, cands, leaves, device, level):
        self.gm, self.cands, self.leaves, self.device, self.level = gm, cands, leaves, device, level
        self.meta = _is_meta(leaves)
        self.values = None
        self.done = {}

    def _inputs(self, external):
        if self.meta:
            # random values, except for inputs that are constants of the graph (a causal mask built from
            # arange/ones): the match may rely on their values (a mask proven causal is dropped), so they
            # are evaluated, as the matcher evaluated them
            gen = torch.Generator().manual_seed(0)
            out = []
            for n in external:
                c = evaluate_constant(n)
                out.append(c if isinstance(c, torch.Tensor) else _verify.random_like(n, gen))
            return out
        if self.values is None or any(n.name not in self.values for n in external):
            # keep only the inputs of the first block of each structure: the others reuse its verdict
            wanted, seen = {n.name for n in external}, set()
            for c in self.cands:
                sub, ext = _verify.extract(self.gm, list(c.nodes), [c.anchor])
                key = _verify.structure_key(sub)
                if key not in seen:
                    seen.add(key)
                    wanted.update(n.name for n in ext)
            self.values = _Values(self.gm, wanted).values(*self.leaves)
        return [self.values[n.name] for n in external]

    def __call__(self, match, cand):
        outs = [match.anchor] + ([match.params["probs_node"]] if match.params.get("probs_used") else [])
        sub, external = _verify.extract(self.gm, list(match.nodes), outs)
        kwargs = _op_kwargs(self.device, cand, self.level)
        key = (_verify.structure_key(sub), tuple(sorted(kwargs.items())))
        if key not in self.done:
            fused_sub = _set_op_kwargs(rewrite(sub, [match], FUSED_OP), {match.anchor: kwargs})
            self.done[key] = _verify.check(sub, fused_sub, self._inputs(external))
        return self.done[key]


class FusedModule(torch.nn.Module):
    """The user's model with its fusible blocks replaced by fused NPU kernels (see :mod:`autofuse.engine`)."""

    def __init__(self, model, example_inputs, device, level, budget, route, verify):
        super().__init__()
        object.__setattr__(self, "_model", model)      # not a submodule: parameters are shared via the graph
        self._device, self._level, self._budget, self._route, self._verify = device, level, budget, route, verify
        self._plans: dict = {}
        self._last = None
        if example_inputs is not None:
            args, kwargs = example_inputs
            self._plan_for(args, kwargs)

    def _plan_for(self, args, kwargs) -> Plan:
        sig = _signature(args, kwargs)
        p = self._plans.get(sig)
        if p is None:
            p = compile_plan(self._model, args, kwargs, self._device, self._level, self._budget, self._route,
                             self._verify)
            self._plans[sig] = p
            # the graph module becomes a child so .parameters() and state_dict see the (shared) tensors
            self.add_module(f"plan{len(self._plans) - 1}", p.graph_module)
        self._last = p
        return p

    def forward(self, *args, **kwargs):
        return self._plan_for(args, kwargs)(*args, **kwargs)

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

    def simulate(self, *args, **kwargs):
        """Run the fused graph on the simulator (fused and unfused ops alike); see :func:`autofuse.simulate`."""
        from autofuse.simulate import simulate_graph
        p = self._plan_for(args, kwargs)
        return simulate_graph(p.graph_module, p.captured.flatten_inputs(*args, **kwargs), self._device)


class AutoFusionEngine:
    """Entry point: ``AutoFusionEngine.fuse(model, ...)`` (also usable as an instance with fixed settings)."""

    def __init__(self, target_device="ascend910", optimization_level="O3", memory_budget=None):
        self.target_device, self.optimization_level, self.memory_budget = (target_device, optimization_level,
                                                                           memory_budget)

    @staticmethod
    def fuse(model, example_inputs=None, target_device="ascend910", optimization_level="O3", memory_budget=None,
             *, route="auto", verify=True) -> FusedModule:
        """Fuse ``model`` for ``target_device``; see the module docstring.

        ``example_inputs``: a tuple of positional inputs, a single tensor, or ``(args, kwargs)`` with a dict as
        second element; tensors may be on the meta device (planning without data). ``memory_budget``: bytes
        or a string such as ``"16GB"``.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"fuse: model must be a torch.nn.Module, got {type(model).__name__}; wrap a function "
                            f"in a module (class M(nn.Module): def forward(self, ...): return fn(...)) or use "
                            f"torch.compile(fn, backend='autofuse')")
        try:
            device = get_device(target_device).name
        except ValueError as e:
            raise ValueError(f"fuse: target_device={target_device!r} is not a known device: "
                             f"{str(e).split(': ', 1)[-1]}") from None
        level = parse_level(optimization_level)
        budget = parse_memory_budget(memory_budget)
        _check_parameter_dtypes(model, device)
        return FusedModule(model, _normalise_inputs(example_inputs), device, level, budget, route, verify)


#: Element types the NPU computes in (the Cube takes fp16/bf16/fp32 operands; there is no float64 unit).
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _dtype_error(what: str, dtype, device: str) -> TypeError:
    return TypeError(f"fuse: {what} is {str(dtype).replace('torch.', '')}; the NPU target {device} computes in "
                     f"float16, bfloat16 and float32: cast the model and its inputs first (model.float() and "
                     f"x.float(), or .half() / .to(torch.bfloat16))")


def _bad_dtype(t) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.dtype not in COMPUTE_DTYPES


def _check_parameter_dtypes(model: torch.nn.Module, device: str):
    for kind, items in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in items:
            if _bad_dtype(t):
                raise _dtype_error(f"{kind} {name!r} of {type(model).__name__}", t.dtype, device)


def _check_input_dtypes(args, kwargs, device: str):
    named = [(f"example input {i}", a) for i, a in enumerate(args)] + \
            [(f"example input {k!r}", v) for k, v in kwargs.items()]
    for what, value in named:
        for leaf in pytree.tree_leaves(value):
            if _bad_dtype(leaf):
                raise _dtype_error(what, leaf.dtype, device)


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


__all__ = ["AutoFusionEngine", "FusedModule", "compile_plan"]
