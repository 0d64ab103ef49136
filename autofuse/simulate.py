"""Whole-graph simulation: every node's kernels run on the NPU simulator, one launch after another.

``simulate_graph(gm, inputs, device)`` walks the graph in order. A node lowers to simulator kernels
(:mod:`autofuse.lower`: matmul, softmax, elementwise, ..., or the fused ``flash_attention``); each runs
on the simulator with the node's real input data and its statistics are added up. Views cost nothing.
The graph's values are computed by torch for unfused nodes (the kernels' own outputs are checked
against torch in the kernel tests; pass ``check=True`` to compare them here too) and by the simulator
for fused ops (a repeated fused launch, whose statistics are reused, gets its values from the kernel's
torch twin, ``autofuse.ops.REFERENCES[name]``, e.g. :func:`autofuse.ops.reference_flash_attention`).

Kernel launches are independent: each starts with a cold L2 and ends with its outputs in HBM, so two
launches of the same kernel on inputs of the same shapes, dtypes and parameters cost the same cycles.
The simulator therefore runs each distinct launch once and reuses its statistics for repeats (a
12-layer model simulates its layer once); ``memo=False`` runs every launch, and so does ``check=True``
(a reused launch's outputs are those of the first launch's data, so they cannot be compared).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx

import cost_model
from autofuse import memory, npu
from autofuse import ops as fused_ops
from autofuse.lower import Arg, Const, lower, step_specs
from cost_model.devices import get_device


@dataclass
class NodeCost:
    node: str
    target: str
    kernels: tuple
    cycles: int
    hbm_bytes: int
    bound: str
    fused: bool = False
    reused: bool = False
    max_error: float | None = None
    workspace: int = 0              # GM its kernels allocate besides their outputs, while they run
    link_bytes: int = 0             # sent on the chip's links (collectives and MC2 kernels)
    link_cycles: int = 0            # the busiest link lane's occupancy


@dataclass
class SimulationResult:
    """Totals and the per-node breakdown of one simulated forward pass."""

    device: str
    cycles: int
    seconds: float
    hbm_bytes: int
    peak_memory: int
    nodes: list = field(default_factory=list)
    outputs: object = None
    launches: int = 0
    distinct_launches: int = 0
    wall_seconds: float = 0.0

    def by_kernel(self) -> dict:
        out: dict = {}
        for n in self.nodes:
            for k in n.kernels:
                out[k] = out.get(k, 0) + n.cycles / max(len(n.kernels), 1)
        return {k: int(v) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}

    def cycles_of(self, names) -> int:
        names = set(names)
        return sum(n.cycles for n in self.nodes if n.node in names)

    def summary(self, top: int = 10) -> str:
        lines = [f"simulated on {self.device}: {self.cycles:,} cycles ({self.seconds * 1e3:.3f} ms), "
                 f"{self.launches} kernel launches ({self.distinct_launches} distinct), HBM {self.hbm_bytes:,} B, "
                 f"peak activation memory {self.peak_memory:,} B"]
        for n in sorted(self.nodes, key=lambda n: -n.cycles)[:top]:
            lines.append(f"  {n.node:<28} {'/'.join(n.kernels):<28} {n.cycles:>12,} cycles  bound {n.bound}"
                         + ("  [fused]" if n.fused else ""))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"device": self.device, "cycles": self.cycles, "seconds": self.seconds, "hbm_bytes": self.hbm_bytes,
                "peak_memory": self.peak_memory, "launches": self.launches,
                "nodes": [n.__dict__ for n in self.nodes]}


_aten = torch.ops.aten
_GEMMS = {_aten.linear.default, _aten.matmul.default, _aten.mm.default, _aten.bmm.default, _aten.addmm.default,
          _aten.baddbmm.default}


def _sig(kernel, arrays, params):
    parts = [kernel]
    for a in arrays:
        parts.append((tuple(a.shape), str(a.dtype)) if isinstance(a, torch.Tensor) else a)
    parts.append(repr(sorted((k, (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else v)
                             for k, v in params.items())))
    return tuple(parts)


class _Sim(fx.Interpreter):
    def __init__(self, gm, device, memo, check):
        # values are freed after their last use *including* uses by lowerings (a matmul reads the source of a
        # transpose it folds), so the interpreter's own bookkeeping is replaced
        super().__init__(gm, garbage_collect_values=False)
        self.device, self.memo, self.check = device, memo, check
        self.cache: dict = {}
        self.records: list[NodeCost] = []
        self.launches = 0
        self.fused_cache: dict = {}
        self.programs = {}
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        last = {}
        for n in gm.graph.nodes:
            prog = lower(n) if n.op == "call_function" else None
            self.programs[n] = prog
            for a in list(n.all_input_nodes) + (list(prog.inputs) if prog is not None else []):
                last[a] = max(last.get(a, 0), order[n])
        self.frees = {}
        for a, i in last.items():
            self.frees.setdefault(i, []).append(a)
        self.order = order

    def run_node(self, n):
        value = self._run(n)
        for a in self.frees.get(self.order[n], ()):
            if a is not n and a.op != "output":
                self.env.pop(a, None)
        return value

    def _value(self, n):
        """The node's value by torch. A float16 GEMM is computed as the Cube computes it, fp32 accumulation
        of the fp16 operands and one rounding of the result (CPU float16 GEMMs are several times slower)."""
        v = n.meta.get("val")
        if n.target in _GEMMS and isinstance(v, torch.Tensor) and v.dtype == torch.float16:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            up = lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.float16 else t  # noqa: E731
            args, kwargs = torch.utils._pytree.tree_map(up, (args, kwargs))
            return n.target(*args, **kwargs).to(torch.float16)
        return super().run_node(n)

    def _tiling(self, kernel, ins_spec, params):
        """The tiling the cost model's search picks for this launch, as the planner priced it: unfused kernels
        run tuned too, so a fusion's speed-up is measured against tuned kernels (None: the kernel's own)."""
        try:     # tensor parameters (a mask, a weight) are read for their shape and dtype only
            e = cost_model.estimate(kernel, ins_spec, device=self.device, **params)
        except (KeyError, NotImplementedError, ValueError, TypeError):
            return None
        return dict(e.tiling) if e.tiling else None

    def _launch(self, kernel, arrays, params):
        self.launches += 1
        key = _sig(kernel, arrays, params)
        # a reused launch's outputs belong to the first launch's data: checking values needs every launch run
        if self.memo and not self.check and key in self.cache:
            return self.cache[key], True
        if kernel not in npu.KERNELS:
            raise KeyError(kernel)
        r = npu.run(kernel, *arrays, device=self.device, **params)
        self.cache[key] = r
        return r, False

    def _run(self, n):
        if n.op != "call_function":
            return super().run_node(n)
        if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "autofuse":
            name = n.target._opname
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            key = _sig(name, args, kwargs)
            twin = fused_ops.REFERENCES.get(name)
            reused = self.memo and not self.check and key in self.fused_cache and twin is not None
            if reused:     # a repeat: the first launch's statistics, the values from the kernel's torch twin
                log = self.fused_cache[key]
                value = twin(*args, **kwargs)
            else:
                with fused_ops.recording() as log:
                    value = super().run_node(n)
                self.fused_cache[key] = log
            self.launches += len(log)
            cyc = sum(s.cycles for _, s in log)
            hbm = sum(s.hbm_bytes for _, s in log)
            self.records.append(NodeCost(n.name, f"autofuse.{name}", tuple(k for k, _ in log) or (name,), cyc, hbm,
                                         log[0][1].bound if log else "", fused=True, reused=reused,
                                         workspace=max((s.workspace_bytes for _, s in log), default=0),
                                         **_link([s for _, s in log])))
            return value
        value = self._value(n)
        prog = self.programs[n]
        if prog.free:
            return value
        args_env = [self.env[a] for a in prog.inputs]
        outs: list = []
        cycles = hbm = 0
        bound, kernels, reused_all, err, ws = "", [], True, None, 0
        launched = []
        specs = step_specs(prog, n)
        for st, (ins_spec, out_spec) in zip(prog.steps, specs):
            arrays = [args_env[r.i] if isinstance(r, Arg) else r.make() if isinstance(r, Const) else outs[r.j]
                      for r in st.inputs]
            if st.kernel == "gather":      # the NPU gathers with int32 indices
                arrays = [a.int() if a.dtype == torch.int64 else a for a in arrays]
            params = {k: (args_env[v.i] if isinstance(v, Arg) else v) for k, v in st.params.items()}
            kernel = st.kernel
            if kernel == "generic":
                params = {"outputs": [out_spec]}
            tiling = self._tiling(kernel, ins_spec, params)
            try:
                r, reused = self._launch(kernel, arrays, {**params, "tiling": tiling} if tiling else params)
            except (KeyError, TypeError, ValueError, NotImplementedError):
                # the kernel is missing or cannot take this instance: price what it moves as a generic op
                kernel = "generic"
                r, reused = self._launch("generic", arrays, {"outputs": [out_spec]})
            outs.append(torch.from_numpy(np.ascontiguousarray(r.outputs[0])) if r.outputs else None)
            cycles += r.stats.cycles
            hbm += r.stats.hbm_bytes
            bound = r.stats.bound
            ws = max(ws, r.stats.workspace_bytes)
            launched.append(r.stats)
            kernels.append(kernel)
            reused_all = reused_all and reused
        if self.check and isinstance(value, torch.Tensor) and outs and outs[-1] is not None \
                and kernels[-1] != "generic" and outs[-1].shape == value.shape:
            err = (outs[-1].double() - value.double()).abs().max().item()
        self.records.append(NodeCost(n.name, str(n.target), tuple(kernels), cycles, hbm, bound, reused=reused_all,
                                     max_error=err, workspace=ws, **_link(launched)))
        return value


def _link(stats) -> dict:
    """Link figures of a node's launches (kernels that communicate: collectives, MC2)."""
    return {"link_bytes": int(sum(s.bytes.get("HBM->link", 0) for s in stats)),
            "link_cycles": int(max((s.busy.get("link", 0) for s in stats), default=0))}


def simulate_graph(gm: fx.GraphModule, inputs, device="ascend910", memo=True, check=False) -> SimulationResult:
    """Simulate one forward pass of ``gm`` on ``inputs`` (the graph's placeholders, in order)."""
    dev = get_device(device)
    meta = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.device.type == "meta"]
    if meta:
        raise ValueError(f"simulate: input {meta[0]} is a meta tensor; the simulator needs data: build the model and "
                         f"its inputs on the CPU (use AutoFusionEngine.fuse on meta inputs to plan without data)")
    t0 = time.perf_counter()
    sim = _Sim(gm, dev.name, memo, check)
    with torch.no_grad():
        out = sim.run(*inputs)
    cycles = sum(r.cycles for r in sim.records)
    workspace = {r.node: r.workspace for r in sim.records if r.workspace}
    peak = memory.peak_bytes(gm, lambda n: workspace.get(n.name, 0))
    return SimulationResult(device=dev.name, cycles=cycles, seconds=cycles / dev.clock_hz,
                            hbm_bytes=sum(r.hbm_bytes for r in sim.records), peak_memory=peak,
                            nodes=sim.records, outputs=out, launches=sim.launches,
                            distinct_launches=len(sim.cache) + sum(len(v) for v in sim.fused_cache.values()), wall_seconds=time.perf_counter() - t0)


def simulate(model, example_inputs, device="ascend910", memo=True, check=False, route="auto") -> SimulationResult:
    """Simulate ``model`` unfused: captured like ``fuse()`` does, then run op by op as eager runs it."""
    from autofuse.capture import capture
    from autofuse.engine import _normalise_inputs
    args, kwargs = _normalise_inputs(example_inputs)
    captured = capture(model, args, kwargs, route=route)
    return simulate_graph(captured.graph_module, captured.flatten_inputs(*args, **kwargs), device, memo=memo,
                          check=check)
