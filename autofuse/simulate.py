"""Whole-graph simulation: every node's kernels run on the NPU simulator, one launch after another.

``simulate_graph(gm, inputs, device)`` walks the graph in order. A node lowers to simulator kernels
(:mod:`autofuse.lower`: matmul, softmax, elementwise, ..., or the fused ``flash_attention``); each runs
on the simulator with the node's real input data and its statistics are added up. Views cost nothing.
The graph's values are computed by torch for unfused nodes (the kernels' own outputs are checked
against torch in the kernel tests; pass ``check=True`` to compare them here too) and by the simulator
for fused ops (a repeated fused launch, whose statistics are reused, gets its values from the kernel's
torch twin, ``autofuse.ops.REFERENCES[name]``, e.g. :func:`autofuse.ops.reference_flash_attention`).
Since an unfused node's values come from torch, its kernels run *timing-only*
(``npu.run(..., timing_only=True)``: the same instructions, timelines and statistics, no values computed,
inputs not copied; only the inputs that steer a kernel's program, such as gather indices, are read).
``check=True`` runs them in full, to compare their values.

``values=False`` simulates timing only, for the whole graph: torch computes just the values some launch
needs, i.e. the values steering a kernel (gather indices, token routing, group sizes) and the inputs of a
fused op's first launch (its kernel runs in full), with everything they depend on; every other node gets its
shape from the graph's metadata (a meta tensor) and its kernels run timing-only on it. The statistics are
those of ``values=True`` (the same launches on the same steering values; tests/test_simulate.py compares
them); there are no outputs. A repeated fused launch then needs no values at all.

Kernel launches are independent: each starts with a cold L2 and ends with its outputs in HBM, so two
launches of the same kernel on inputs of the same shapes, dtypes, parameters and steering values cost the
same cycles.
The simulator therefore runs each distinct launch once and reuses its statistics for repeats (a
12-layer model simulates its layer once); ``memo=False`` runs every launch, and so does ``check=True``
(a reused launch's outputs are those of the first launch's data, so they cannot be compared).
"""
from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx

import cost_model
from autofuse import memory, npu
from autofuse.graph import checkpoint_of, keeps_checkpoints
from autofuse.npu.run import ALL, STEER, input_names
from autofuse import ops as fused_ops
from autofuse.ops_moe import _group_counts
from autofuse.lower import Arg, Const, Out, View, known_specs, known_tensor, lower, step_specs
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
    phase: str = ""                 # in a training step (autofuse.training): "forward", "backward" or "recompute"


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
    joint: object = None            # a training step's JointGraph (autofuse.training), else None

    @property
    def phases(self) -> dict:
        """Cycles per phase of a training step (``{"forward": ..., "backward": ...}``, and ``"recompute"`` where the
        forward keeps activation checkpoints: their ops run again in the backward); a forward pass alone is all
        ``"forward"``."""
        out = {"forward": 0, "backward": 0}
        for n in self.nodes:
            out[n.phase or "forward"] = out.get(n.phase or "forward", 0) + n.cycles
        return out

    def by_kernel(self) -> dict:
        out: dict = {}
        for n in self.nodes:
            for k in n.kernels:
                out[k] = out.get(k, 0) + n.cycles / max(len(n.kernels), 1)
        return {k: int(v) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}

    def cycles_of(self, names) -> int:
        names = set(names)
        return sum(n.cycles for n in self.nodes if n.node in names)

    def __str__(self) -> str:       # print(result): the summary; repr() keeps every field
        return self.summary()

    def summary(self, top: int = 10) -> str:
        lines = [f"simulated on {self.device}: {self.cycles:,} cycles ({self.seconds * 1e3:.3f} ms), "
                 f"{self.launches} kernel launch{'' if self.launches == 1 else 'es'} ({self.distinct_launches} "
                 f"distinct), HBM {self.hbm_bytes:,} B, "
                 f"peak activation memory {self.peak_memory:,} B"]
        if self.joint is not None:
            ph = self.phases
            lines.append(f"  training step: forward {ph['forward']:,} cycles, backward {ph['backward']:,} cycles"
                         + (f" (and {ph['recompute']:,} recomputing the activation checkpoints' ops)"
                            if "recompute" in ph else ""))
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


BLOCK_BYTES = 256 << 20        # the largest fp32 intermediate of a value computed in blocks


def _row_blocks(target, args, out):
    """``(argument positions to slice, rows per block)`` to compute a GEMM's value in blocks of its output's
    dim 0 when its fp32 result would exceed ``BLOCK_BYTES``, or None. Only forms whose output rows come from
    the sliced operands' rows alone: ``linear``/``mm``/``addmm`` (rows of the activation) and ``matmul``/``bmm``
    over a shared leading (batch) dim. Blocks are whole multiples of 256 rows (or of one leading index), so
    BLAS sees the same row blocking it uses for the whole product."""
    if out.dim() < 2 or out.numel() * 4 <= BLOCK_BYTES:
        return None
    a = {_aten.linear.default: 0, _aten.mm.default: 0, _aten.addmm.default: 1}.get(target)
    if a is not None:
        split = {a}
        if target is _aten.linear.default and args[0].dim() < 2:
            return None
        if target is _aten.addmm.default and args[0].dim() == 2 and args[0].shape[0] == out.shape[0] > 1:
            split.add(0)                   # a full [M, N] input is added row by row too
    elif target in (_aten.matmul.default, _aten.bmm.default):
        x, w = args[0], args[1]
        if x.dim() < 3 or x.shape[0] != out.shape[0]:
            return None
        if w.dim() <= 2:
            split = {0}
        elif w.dim() == x.dim() and w.shape[0] == x.shape[0]:
            split = {0, 1}
        else:
            return None
    else:
        return None
    per_row = out.numel() // out.shape[0] * 4
    step = max(1, BLOCK_BYTES // per_row)
    if out.dim() == 2:
        step = max(256, step // 256 * 256)
    return (split, step) if step < out.shape[0] else None


def _twin_value(name, twin, args, kwargs):
    """A fused op's values from its torch twin; attention by batch index when its fp32 scores would exceed
    ``BLOCK_BYTES`` (each batch index's outputs come from its own q, k, v and mask rows alone)."""
    if name != "flash_attention":
        return twin(*args, **kwargs)
    q, k = args[0], args[1]
    if q.shape[0] < 2 or q.numel() // q.shape[-1] * k.shape[-2] * 4 <= BLOCK_BYTES:
        return twin(*args, **kwargs)
    B = q.shape[0]
    mask = args[3] if len(args) > 3 else kwargs.get("mask")
    split_mask = isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[0] == B

    def part(b):
        a = [t[b:b + 1] if i < 3 or (i == 3 and split_mask) else t for i, t in enumerate(args)]
        kw = dict(kwargs)
        if "mask" in kw and split_mask:
            kw["mask"] = mask[b:b + 1]
        return twin(*a, **kw)

    parts = [part(b) for b in range(B)]
    batch_dim = (0, 0, 1)          # out, probs: batch first; the row statistics: [2, B, N, Sq]
    return tuple(torch.cat([p[i] for p in parts], batch_dim[i]) if parts[0][i].dim() and parts[0][i].numel()
                 else parts[0][i] for i in range(len(parts[0])))


def _spec(a):
    if isinstance(a, torch.Tensor):
        return tuple(a.shape), str(a.dtype)
    if isinstance(a, npu.Absent):
        return tuple(a.shape), a.element or str(a.dtype)
    if isinstance(a, (list, tuple)):
        return tuple(_spec(x) for x in a)       # a list of tensors (a grouped GEMM's per-group weights)
    return a


def _sig(kernel, arrays, params, steering=()):
    """What a launch's cost depends on: kernel, shapes, dtypes, parameters and the values of ``steering``
    tensors (a digest)."""
    parts = [kernel]
    for a in arrays:
        parts.append(_spec(a))
    parts.append(repr(sorted((k, _spec(v)) for k, v in params.items())))
    for t in steering:
        t = t.detach().contiguous().reshape(-1)       # 0-d tensors too
        parts.append(hashlib.sha1(t.view(torch.uint8).numpy() if t.numel() else b"").hexdigest())
    return tuple(parts)


def _steering(kernel, arrays, params) -> list:
    """The tensors among a launch's inputs whose values steer the kernel's program (``npu.run.STEER``)."""
    steer = STEER.get(kernel, ())
    if not steer:
        return []
    if steer == ALL:
        return [a for a in list(arrays) + list(params.values()) if isinstance(a, torch.Tensor)]
    names = input_names(npu.KERNELS[kernel], len(arrays))
    return [a for n, a in zip(names, arrays) if n in steer and isinstance(a, torch.Tensor)] + \
        [v for k, v in params.items() if k in steer and isinstance(v, torch.Tensor)]


class _Sim(fx.Interpreter):
    def __init__(self, gm, device, memo, check, values=True):
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
        # values=False: the nodes whose values some launch needs, with what they depend on (None: all)
        self.needed = None if values else _needed(gm, self.programs, memo)

    def run_node(self, n):
        if self.needed is not None and n not in self.needed and n.op == "call_function" and \
                _fused_name(n) is None:
            value = _meta_value(n.meta.get("val"))        # no launch needs it: its shape is enough
            prog = self.programs[n]
            if prog is not None and not prog.free:
                self._kernels(n, prog, value)
        else:
            value = self._run(n)
        for a in self.frees.get(self.order[n], ()):
            if a is not n and a.op != "output":
                self.env.pop(a, None)
        return value

    def _value(self, n):
        """The node's value by torch. A float16 GEMM is computed as the Cube computes it, fp32 accumulation
        of the fp16 operands and one rounding of the result (CPU float16 GEMMs are several times slower); a
        large one in blocks of output rows (:func:`_row_blocks`), so its fp32 result never exists whole."""
        v = n.meta.get("val")
        if n.target in _GEMMS and isinstance(v, torch.Tensor) and v.dtype == torch.float16:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            up = lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.float16 else t  # noqa: E731
            blocks = _row_blocks(n.target, args, v)
            if blocks is None:
                args, kwargs = torch.utils._pytree.tree_map(up, (args, kwargs))
                return n.target(*args, **kwargs).to(torch.float16)
            split, step = blocks
            out = torch.empty(v.shape, dtype=torch.float16)
            for r in range(0, v.shape[0], step):
                part = [a[r:r + step] if i in split else a for i, a in enumerate(args)]
                part, kw = torch.utils._pytree.tree_map(up, (part, kwargs))
                out[r:r + step] = n.target(*part, **kw)
            return out
        return super().run_node(n)

    def _tiling(self, kernel, ins_spec, params, arrays=()):
        """The tiling the cost model's search picks for this launch, as the planner priced it: unfused kernels
        run tuned too, so a fusion's speed-up is measured against tuned kernels (None: the kernel's own). A
        per-expert matmul loop is tuned for the row counts this launch's group list gives (the planner, without
        the routing, prices balanced groups; a tiling searched for those rows left every other count to the
        kernel's default: 7.55 M cycles instead of 5.17 M for a Mixtral-8x7B gate_up loop)."""
        if kernel in _PER_GROUP and len(arrays) > 2 and isinstance(arrays[2], torch.Tensor) \
                and arrays[2].device.type != "meta" and "group_sizes" not in params:
            sizes = _group_counts(arrays[2].reshape(-1), params.get("group_list_type", "cumsum"))
            params = {**params, "group_sizes": sizes.tolist()}
        try:     # tensor parameters (a mask, a weight) are read for their shape and dtype only
            e = cost_model.estimate(kernel, ins_spec, device=self.device, **params)
        except (KeyError, NotImplementedError, ValueError, TypeError):
            return None
        return dict(e.tiling) if e.tiling else None

    def _launch(self, kernel, arrays, params, timing_only):
        """``(stats, outputs, reused)`` of one launch; outputs are Absent (shapes) when ``timing_only``. A launch
        counts once it has run (or reused a run): one the kernel cannot take raises uncounted, and the generic
        launch that replaces it is the one counted."""
        if kernel not in npu.KERNELS:
            raise KeyError(kernel)
        steering = _steering(kernel, arrays, params)
        key = _sig(kernel, arrays, params, steering)
        # a repeat reuses the statistics and the outputs' shapes; a launch whose values are used (checked, or
        # steering a later step) runs every time: a reused launch's values would be the first launch's
        if self.memo and timing_only and key in self.cache:
            self.launches += 1
            return (*self.cache[key], True)
        r = npu.run(kernel, *arrays, device=self.device, timing_only=timing_only, **params)
        self.launches += 1
        shapes = tuple(npu.Absent(o.shape, np.float32, dt) for o, dt in zip(r.outputs, r.dtypes))
        self.cache[key] = (r.stats, shapes)        # never values
        return r.stats, (shapes if timing_only else tuple(r.torch_outputs())), False

    def _run(self, n):
        if n.op != "call_function":
            return super().run_node(n)
        name = _fused_name(n)
        if name is not None:
            args, kwargs = _required_positional(n.target, *self.fetch_args_kwargs_from_env(n))
            key = _sig(name, args, kwargs, _steered_args(n.target, name, args, kwargs))
            twin = fused_ops.REFERENCES.get(name)
            reused = self.memo and not self.check and key in self.fused_cache and twin is not None
            if reused and self.needed is not None and n not in self.needed:    # timing only: shapes suffice
                log = self.fused_cache[key]
                value = _meta_value(n.meta.get("val"))
            elif reused:   # a repeat: the first launch's statistics, the values from the kernel's torch twin
                log = self.fused_cache[key]
                value = _twin_value(name, twin, args, kwargs)
            elif self.needed is not None and n not in self.needed and name in fused_ops.TIMING:
                log = fused_ops.TIMING[name](*args, **kwargs)       # its launches on shapes alone
                value = _meta_value(n.meta.get("val"))
                self.fused_cache[key] = log
            else:
                if self.needed is not None and n not in self.needed:
                    raise RuntimeError(f"simulate: fused call {n.name} ({name}) has no values and no earlier launch "
                                       f"of its signature to reuse; its signature from the graph's metadata differs "
                                       f"from the one at run time: simulate with values=True")
                with fused_ops.recording() as log:
                    value = super().run_node(n)
                self.fused_cache[key] = log
            self.launches += len(log)
            cyc = sum(s.cycles for _, s in log)
            hbm = sum(s.hbm_bytes for _, s in log)
            self.records.append(NodeCost(n.name, f"autofuse.{name}", tuple(k for k, _ in log) or (name,), cyc, hbm,
                                         log[0][1].bound if log else "", fused=True, reused=reused,
                                         workspace=max((s.workspace_bytes for _, s in log), default=0),
                                         phase=n.meta.get("autofuse_phase", ""), **_link([s for _, s in log])))
            return value
        value = self._value(n)
        prog = self.programs[n]
        if not prog.free:
            self._kernels(n, prog, value)
        return value

    def _kernels(self, n, prog, value):
        """Run the kernels of ``n``'s lowering and record what they cost."""
        args_env = [self.env[a] for a in prog.inputs]
        outs: list = []
        cycles = hbm = 0
        bound, kernels, reused_all, err, ws = "", [], True, None, 0
        launched = []
        specs = step_specs(prog, n)
        # torch gave the node's value: the kernels only need timing, unless values are checked or a later
        # step's steering input is an earlier step's output
        timing_only = not self.check and not _steered_by_outputs(prog)
        for st, (ins_spec, out_spec) in zip(prog.steps, specs):
            arrays = [_ref_value(r, args_env, outs) for r in st.inputs]
            if st.kernel == "generic":
                arrays, out_spec = _moved(arrays, out_spec)
            if st.kernel == "gather":      # the NPU gathers with int32 indices
                arrays = [a.int() if a.dtype == torch.int64 else a for a in arrays]
            params = {k: (args_env[v.i] if isinstance(v, Arg) else v) for k, v in st.params.items()}
            kernel = st.kernel
            if kernel == "generic":
                params = {"outputs": [out_spec]}
            tiling = self._tiling(kernel, ins_spec, params, arrays)
            # an unfused dropout's keep bits: its values are torch's (the node's value); the generator is timed
            step_timing = timing_only or kernel == "dropout_gen_mask"
            try:
                stats, o, reused = self._launch(kernel, arrays, {**params, "tiling": tiling} if tiling else params,
                                                step_timing)
            except (KeyError, TypeError, ValueError, NotImplementedError):
                # the kernel is missing or cannot take this instance: price what it moves as a generic op
                kernel = "generic"
                arrays, out_spec = _moved(arrays, out_spec)
                stats, o, reused = self._launch("generic", arrays, {"outputs": [out_spec]}, timing_only)
            outs.append(o[0] if o else None)
            cycles += stats.cycles
            hbm += stats.hbm_bytes
            bound = stats.bound
            ws = max(ws, stats.workspace_bytes)
            launched.append(stats)
            kernels.append(kernel)
            reused_all = reused_all and reused
        if self.check and isinstance(value, torch.Tensor) and outs and isinstance(outs[-1], torch.Tensor) \
                and kernels[-1] != "generic" and outs[-1].shape == value.shape:
            err = (outs[-1].double() - value.double()).abs().max().item()
        self.records.append(NodeCost(n.name, str(n.target), tuple(kernels), cycles, hbm, bound, reused=reused_all,
                                     max_error=err, workspace=ws, phase=n.meta.get("autofuse_phase", ""),
                                     **_link(launched)))


def _moved(arrays, out_spec):
    """A generic launch's inputs and output as the device moves them: complex values as their float pairs,
    float8 as bytes (the simulator's dtypes are the cost model's)."""
    return [known_tensor(a) for a in arrays], known_specs(out_spec, set())


def _ref_value(r, args_env, outs):
    """The array a lowered step reads for input reference ``r`` (:mod:`autofuse.lower`)."""
    if isinstance(r, View):
        return r.of(_ref_value(r.ref, args_env, outs))
    return args_env[r.i] if isinstance(r, Arg) else r.make() if isinstance(r, Const) else outs[r.j]


def _link(stats) -> dict:
    """Link figures of a node's launches (kernels that communicate: collectives, MC2)."""
    return {"link_bytes": int(sum(s.bytes.get("HBM->link", 0) for s in stats)),
            "link_cycles": int(max((s.busy.get("link", 0) for s in stats), default=0))}


def _required_positional(op, args, kwargs):
    """``(args, kwargs)`` of a call of ``op`` with its required arguments positional and the others by name, as
    the torch twins take them (a graph traced by make_fx passes every argument positionally)."""
    schema = op._schema.arguments
    required = sum(1 for a in schema if not a.has_default_value() and not a.kwarg_only)
    if len(args) <= required:
        return args, kwargs
    return tuple(args[:required]), {**{a.name: v for a, v in zip(schema[required:], args[required:])}, **kwargs}


#: kernels that run one matmul launch per group, over the rows the group list (their third input) gives
_PER_GROUP = frozenset({"matmul_per_group", "matmul_per_group_weight_grad"})


def _steered_args(target, name, args, kwargs) -> list:
    """A fused op's given arguments (positional or by keyword) that its kernel (``ops.STEERED``) declares as
    steering inputs, by name (every tensor argument for ``ALL``): tensors, or the graph nodes that will hold
    them."""
    kernel = fused_ops.STEERED.get(name)
    if kernel is None:
        return []
    steer = STEER.get(kernel, ())
    got = [args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(target._schema.arguments)
           if steer == ALL or a.name in steer]
    return [v for v in got if isinstance(v, (torch.Tensor, fx.Node))]


def _fused_name(n):
    """The fused op's name if ``n`` calls ``torch.ops.autofuse.*``, else None."""
    t = n.target
    return t._opname if isinstance(t, torch._ops.OpOverload) and t.namespace == "autofuse" else None


def _meta_value(v):
    """A stand-in with the shape, dtype and strides of the graph's value ``v`` and no data (meta device)."""
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="meta")
    if isinstance(v, (list, tuple)):
        return type(v)(_meta_value(x) for x in v)
    return v


def _steering_args(prog) -> set:
    """Positions (into ``prog.inputs``) of the node inputs some step of ``prog`` reads as steering values."""
    out = set()
    for st in prog.steps:
        steer = STEER.get(st.kernel, ())
        if not steer or st.kernel not in npu.KERNELS:
            continue
        names = input_names(npu.KERNELS[st.kernel], len(st.inputs))
        refs = [r for nm, r in zip(names, st.inputs) if steer == ALL or nm in steer]
        refs += [v for k, v in st.params.items() if steer == ALL or k in steer]
        out.update(r.i for r in refs if isinstance(r, Arg))
    return out


def _needed(gm, programs, memo) -> set:
    """The nodes whose values a timing-only simulation must compute: every input that steers an unfused kernel
    (a whole program when an earlier step's output steers a later one), the steering inputs of a fused op
    timed on shapes (``ops.TIMING``, ``ops.STEERED``), every input of any other fused op's first launch (its
    kernel runs in full; every launch of it when its values steer its cost, or without the memo or a torch
    twin, as with values), and what those depend on."""
    roots, seen = [], set()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = _fused_name(n)
        if name is not None:
            steering = _steered_args(n.target, name, n.args, n.kwargs)
            if name in fused_ops.TIMING:      # timed on shapes (and its steering values) alone
                roots += [a for a in steering if isinstance(a, fx.Node)]
                continue
            if steering:                      # its cost follows its values: every launch runs in full
                roots.append(n)
                continue
            key = _sig(name, *torch.utils._pytree.tree_map(
                lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, (n.args, n.kwargs)))
            if not memo or name not in fused_ops.REFERENCES or key not in seen:
                seen.add(key)
                roots.append(n)
            continue
        prog = programs[n]
        if prog is None or prog.free:
            continue
        if _steered_by_outputs(prog):
            roots.append(n)
        else:
            roots += [prog.inputs[i] for i in _steering_args(prog)]
    needed = set()
    while roots:
        n = roots.pop()
        if n not in needed:
            needed.add(n)
            roots += n.all_input_nodes
    return needed


def _steered_by_outputs(prog) -> bool:
    """Whether a step's steering input is an earlier step's output (its values are needed to time it)."""
    for st in prog.steps:
        steer = STEER.get(st.kernel, ())
        if steer == ALL:
            bound = [True] * len(st.inputs)
        elif steer and st.kernel in npu.KERNELS:
            bound = [n in steer for n in input_names(npu.KERNELS[st.kernel], len(st.inputs))]
        else:
            continue
        if any(b and isinstance(r, Out) for b, r in zip(bound, st.inputs)):
            return True
    return False


def _recompute(res: SimulationResult, joint: fx.GraphModule) -> None:
    """A training step whose forward keeps activation checkpoints (:mod:`autofuse.checkpointing`) runs each
    checkpoint's ops again in the backward: their forward kernels, priced again as the ``"recompute"`` phase."""
    by_name = {n.name: n for n in joint.graph.nodes}
    again = []
    for r in res.nodes:
        n = by_name.get(r.node)
        source = n.meta.get("autofuse_source") if n is not None else None
        if r.phase == "forward" and source is not None and checkpoint_of(source) is not None:
            again.append(dataclasses.replace(r, phase="recompute", reused=True))
    res.nodes.extend(again)
    res.cycles += sum(r.cycles for r in again)
    res.hbm_bytes += sum(r.hbm_bytes for r in again)
    res.seconds = res.cycles / get_device(res.device).clock_hz
    res.launches += sum(len(r.kernels) for r in again)


def simulate_graph(gm: fx.GraphModule, inputs, device="ascend910", memo=True, check=False,
                   values=True, backward=False) -> SimulationResult:
    """Simulate one forward pass of ``gm`` on ``inputs`` (the graph's placeholders, in order). ``values=False``:
    timing only (module docstring); the result has no outputs. ``backward=True``: one training step, the
    forward and the backward of every trainable parameter (:mod:`autofuse.training`); ``result.phases``
    splits the cycles, the outputs are the forward's followed by the gradients."""
    if backward:
        from autofuse.training import joint_graph
        joint = joint_graph(gm, inputs)
        res = simulate_graph(joint.graph_module, joint.arguments(inputs), device, memo, check, values)
        res.joint = joint
        if keeps_checkpoints(gm):
            _recompute(res, joint.graph_module)
        return res
    if check and not values:
        raise ValueError("simulate: check=True compares kernel values with torch's; it needs values=True")
    dev = get_device(device)
    meta = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.device.type == "meta"]
    if meta:
        raise ValueError(f"simulate: input {meta[0]} is a meta tensor; the simulator needs data: build the model and "
                         f"its inputs on the CPU (use AutoFusionEngine.fuse on meta inputs to plan without data)")
    t0 = time.perf_counter()
    sim = _Sim(gm, dev.name, memo, check, values)
    with torch.no_grad():
        out = sim.run(*inputs)
    if not values:
        out = None
    cycles = sum(r.cycles for r in sim.records)
    workspace = {r.node: r.workspace for r in sim.records if r.workspace}
    peak = memory.peak_bytes(gm, lambda n: workspace.get(n.name, 0))
    return SimulationResult(device=dev.name, cycles=cycles, seconds=cycles / dev.clock_hz,
                            hbm_bytes=sum(r.hbm_bytes for r in sim.records), peak_memory=peak,
                            nodes=sim.records, outputs=out, launches=sim.launches,
                            distinct_launches=len(sim.cache) + sum(len(v) for v in sim.fused_cache.values()), wall_seconds=time.perf_counter() - t0)


def simulate(model, example_inputs, device="ascend910", memo=True, check=False, route="auto",
             values=True, backward=False) -> SimulationResult:
    """Simulate ``model`` unfused: checked and captured like ``fuse()`` does (an ``nn.Module`` or an
    ``ExportedProgram``, in the dtypes the NPU computes in, a float64 input only where the model casts it first),
    then run op by op as eager runs it
    (``values=False``: timing only; ``backward=True``: a training step, forward and backward; see
    :func:`simulate_graph`)."""
    from autofuse.capture import capture
    from autofuse.engine import _check_input_dtypes, _normalise_inputs, check_model
    model, example_inputs, device = check_model(model, example_inputs, device, who="simulate", device_arg="device")
    if example_inputs is None:
        raise ValueError("simulate: example_inputs is None; give the inputs to run the model on (a tensor, a tuple "
                         "of positional inputs or (args, kwargs))")
    args, kwargs = _normalise_inputs(example_inputs)
    captured = capture(model, args, kwargs, route=route)
    _check_input_dtypes(captured.graph_module, args, kwargs, device, who="simulate")
    return simulate_graph(captured.graph_module, captured.flatten_inputs(*args, **kwargs), device, memo=memo,
                          check=check, values=values, backward=backward)
