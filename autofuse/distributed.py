"""N simulated NPUs under torch.distributed: every rank fuses its shard with the engine and simulates its chip.

    from autofuse.distributed import simulate_world
    world = simulate_world(build, world_size=4, device="ascend910b")   # build(rank, world) -> (module, args)
    print(world.summary())      # per rank and system (slowest rank) cycles, decisions, every collective

Each rank is one process (``torch.multiprocessing``, gloo on loopback) and simulates its own chip. On a rank
(:func:`rank_pipeline`, torch.distributed initialised):

1. **fuse** the rank's shard with :meth:`autofuse.AutoFusionEngine.fuse`. Functional collectives
   (``torch.distributed._functional_collectives``) capture as ``_c10d_functional.*`` + ``wait_tensor`` nodes;
   the MC2 families (``patterns/mc2.py``, ``autofuse/fused_mc2.py``) find every matmul + collective pair and
   the planner fuses it at its best tile count or rejects it with its reason code (``not_profitable`` with
   both prices, ``unsupported`` with what keeps it from fusing). Verification runs the captured pair and the
   fused op on this rank's data, communicating with the other ranks in lockstep; the verdict is the group's.
2. **simulate** the captured graph (every op a launch: the matmul, then the collective) and the fused graph
   with :func:`autofuse.simulate.simulate_graph`. Collective nodes run the collective kernels over the group's
   ranks (``autofuse.lower``), MC2 ops their kernels; both exchange real data and arrival times with the other
   ranks through gloo. A rank's time is the sum of its launches; the system's is the slowest rank's. The second
   baseline, generic fusion alone, is the shard planned again with every pattern family off, simulated alike.
3. **report** every launch that used the links: its bytes on the link, the busiest lane's occupancy (link
   time), its cycles, and what it overlapped with — nothing for a collective launched on its own; for an MC2
   launch, the matmul it is fused with and the cycles that hid (the pair's launches in the unfused simulation
   minus the fused launch).
4. with ``backward=True`` (``autofuse simulate --world-size N --backward``), **a training step** of both graphs
   (:mod:`autofuse.training`: the forward and the backward traced together, the rank's input requiring grad as
   a layer's inside a model does), simulated like the forward: each phase's cycles per rank, fused vs unfused.
   The fused graph's backward is what its MC2 ops register (``autofuse/ops_mc2.py``: the dual MC2 launch and
   ``matmul`` launches), the same function as the captured graph's: torch's autograd of the functional
   collectives, where in torch 2.13 ``all_reduce``'s backward all-reduces the gradient (an all-reduce launch per
   row-parallel layer in both steps; for an in-place ``torch.distributed.all_reduce`` the fused backward is the
   identity, as eager's). The report names the backward's launches on the links.

:func:`simulate_world` starts the ranks on this machine (what ``autofuse simulate --world-size N`` calls).
"""
from __future__ import annotations

import os
import pickle
import socket
import traceback
from dataclasses import dataclass, field

import torch

from autofuse.hierarchy import lead_match

MC2_FAMILIES = ("matmul_all_reduce", "matmul_reduce_scatter", "all_gather_matmul")
COLLECTIVE_KERNELS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all") + MC2_FAMILIES


@dataclass
class CollectiveCost:
    """One launch that used the links."""

    node: str
    kind: str                      # its kernel
    bytes: int                     # sent on the link by this rank
    link_cycles: int               # busiest lane's occupancy
    cycles: int                    # the launch (kernel time)
    overlapped_with: str = ""      # "" for a collective launched on its own; an MC2 launch: its matmul
    hidden_cycles: int = 0         # MC2: the pair's two launches (unfused simulation) minus the fused launch
    phase: str = ""                # in a training step: "forward" or "backward"


@dataclass
class GraphRun:
    cycles: int
    launches: int
    collectives: list = field(default_factory=list)
    phases: dict = field(default_factory=dict)       # a training step's cycles per phase


@dataclass
class RankResult:
    rank: int
    device: str
    fused: GraphRun
    unfused: GraphRun
    decisions: list                # the engine's FusionDecisions of this rank's plan
    max_abs_diff: float            # fused graph's outputs vs the captured graph's, both simulated on this rank
    outputs: object = None
    outputs_unfused: object = None
    step: GraphRun | None = None            # backward=True: the fused graph's training step
    step_unfused: GraphRun | None = None    # and the captured graph's
    step_grads: dict | None = None          # the fused step's gradients: parameter name -> tensor
    step_grad_outputs: list | None = None   # the output gradients both steps took
    generic: GraphRun | None = None         # the plan of automatic discovery alone (every pattern family off)
    step_generic: GraphRun | None = None    # backward=True: its training step
    generic_label: str = "generic fusion alone"     # that baseline as reports name it (its level, its switches)

    @property
    def speedup(self) -> float:
        return self.unfused.cycles / self.fused.cycles if self.fused.cycles else 0.0

    @property
    def pairs(self) -> list:
        """The decisions about matmul + collective pairs."""
        return [d for d in self.decisions if d.pattern in MC2_FAMILIES]


@dataclass
class WorldResult:
    world_size: int
    device: str
    ranks: list

    @property
    def cycles(self) -> int:
        """The system's time: its slowest rank."""
        return max(r.fused.cycles for r in self.ranks)

    @property
    def cycles_unfused(self) -> int:
        return max(r.unfused.cycles for r in self.ranks)

    @property
    def cycles_generic(self) -> int | None:
        """The system's time under the plan of automatic discovery alone (the second baseline)."""
        runs = [r.generic for r in self.ranks]
        return max(g.cycles for g in runs) if all(g is not None for g in runs) else None

    @property
    def speedup(self) -> float:
        return self.cycles_unfused / self.cycles if self.cycles else 0.0

    def to_dict(self) -> dict:
        """Keys as before (``cycles_unfused``: eager op by op), and the baselines under the names the reports use
        (``baselines``: ``eager op by op``, ``generic fusion alone``)."""
        return {"world_size": self.world_size, "device": self.device, "cycles": self.cycles,
                "cycles_unfused": self.cycles_unfused, "cycles_generic": self.cycles_generic,
                "baselines": {"eager op by op": self.cycles_unfused, "generic fusion alone": self.cycles_generic},
                "speedup": round(self.speedup, 4),
                "ranks": [{"rank": r.rank, "cycles": r.fused.cycles, "cycles_unfused": r.unfused.cycles,
                           "cycles_generic": r.generic.cycles if r.generic is not None else None,
                           "max_abs_diff": r.max_abs_diff, "decisions": [d.to_dict() for d in r.decisions],
                           "collectives": [c.__dict__ for c in r.fused.collectives],
                           "collectives_unfused": [c.__dict__ for c in r.unfused.collectives],
                           **({"step": _as_dict(r.step), "step_unfused": _as_dict(r.step_unfused)}
                              if r.step is not None else {}),
                           **({"step_generic": _as_dict(r.step_generic)} if r.step_generic is not None else {})}
                          for r in self.ranks]}

    def __str__(self) -> str:       # print(result): the summary; repr() keeps every field
        return self.summary()

    def summary(self) -> str:
        from cost_model.devices import get_device
        clock = get_device(self.device).clock_hz
        slow = max(self.ranks, key=lambda r: r.fused.cycles)
        generic, label = self.cycles_generic, self.ranks[0].generic_label
        lines = [f"{self.world_size} ranks on {self.device}: system {self.cycles:,} cycles "
                 f"({self.cycles / clock * 1e6:,.1f} µs) fused vs {self.cycles_unfused:,} unfused, eager op by op "
                 f"({self.speedup:.2f}x)"
                 + (f", and {generic:,} with {label} ({generic / max(self.cycles, 1):.2f}x)"
                    if generic is not None else "")
                 + f"; the slowest rank each, rank {slow.rank} fused"]
        for r in self.ranks:
            lines.append(f"  rank {r.rank}: {r.fused.cycles:,} fused / {r.unfused.cycles:,} unfused"
                         + (f" / {r.generic.cycles:,} generic" if r.generic is not None else "")
                         + f" cycles ({r.speedup:.2f}x), {r.fused.launches} / {r.unfused.launches} launches, "
                           f"outputs differ by {r.max_abs_diff:.3g}")
        lines.append("  matmul + collective pairs (rank 0):")
        for d in self.ranks[0].pairs:
            lines.append(f"    {'fused' if d.applied else 'kept '} {d.pattern:22s} at {d.anchor}: "
                         f"[{d.reason_code}] {d.reason}")
        lines.append("  launches on the links (rank 0, fused graph):")
        for c in self.ranks[0].fused.collectives:
            ov = (f"overlapped with {c.overlapped_with}; {c.hidden_cycles:,} cycles less than the pair's two "
                  f"launches" if c.overlapped_with else "a launch of its own")
            lines.append(f"    {c.kind:22s} {c.node}: {c.bytes:,} B sent, link busy {c.link_cycles:,} of "
                         f"{c.cycles:,} cycles; {ov}")
        if self.ranks[0].step is not None:
            lines += self._step_lines()
        return "\n".join(lines)

    def _step_lines(self) -> list:
        step = max(r.step.cycles for r in self.ranks)
        step_u = max(r.step_unfused.cycles for r in self.ranks)
        generic = [r.step_generic for r in self.ranks]
        step_g = max(g.cycles for g in generic) if all(g is not None for g in generic) else None
        lines = [f"  training step (forward + backward): system {step:,} cycles fused vs {step_u:,} unfused "
                 f"({step_u / max(step, 1):.2f}x)"
                 + (f", {step_g:,} with {self.ranks[0].generic_label} ({step_g / max(step, 1):.2f}x)"
                    if step_g is not None else "") + "; the slowest rank each"]
        for r in self.ranks:
            f, u = r.step.phases, r.step_unfused.phases
            lines.append(f"    rank {r.rank}: forward {f['forward']:,} / {u['forward']:,}, backward "
                         f"{f['backward']:,} / {u['backward']:,} cycles (fused / unfused), {r.step.launches} / "
                         f"{r.step_unfused.launches} launches")
        for side, run in (("fused", self.ranks[0].step), ("unfused", self.ranks[0].step_unfused)):
            back = [c for c in run.collectives if c.phase == "backward"]
            lines.append(f"    backward launches on the links (rank 0, {side}): "
                         + (", ".join(f"{c.kind} {c.node} {c.cycles:,} cycles" for c in back) or "none"))
        return lines


def _as_dict(run: GraphRun) -> dict:
    return {**run.__dict__, "collectives": [c.__dict__ for c in run.collectives]}


def _origin(plan, canonical_name: str) -> str:
    n = next((n for n in plan.canonical.graph.nodes if n.name == canonical_name), None)
    return n.meta.get("autofuse_origin", canonical_name) if n is not None else canonical_name


def _run(sim, gm, decisions=(), plan=None, unfused_sim=None) -> GraphRun:
    """The launches of ``sim`` that used the links, with what each MC2 launch overlapped."""
    by_anchor = {d.anchor: d for d in decisions if d.applied}
    nodes = {n.name: n for n in gm.graph.nodes}
    colls = []
    for rec in sim.nodes:
        if not rec.link_bytes and not any(k in COLLECTIVE_KERNELS for k in rec.kernels):
            continue
        cost = CollectiveCost(rec.node, rec.kernels[0], rec.link_bytes, rec.link_cycles, rec.cycles, phase=rec.phase)
        m = lead_match(nodes[rec.node]) if rec.node in nodes else None
        d = by_anchor.get(_origin(plan, m.anchor)) if m is not None and plan is not None else None
        if d is not None and unfused_sim is not None:
            matmuls = [n for n in d.nodes if _is_matmul(plan, n)]
            cost.overlapped_with = "matmul " + ", ".join(matmuls) if matmuls else "its matmul"
            cost.hidden_cycles = unfused_sim.cycles_of(d.nodes) - rec.cycles
        colls.append(cost)
    return GraphRun(sim.cycles, sim.launches, colls, sim.phases if sim.joint is not None else {})


def _is_matmul(plan, name: str) -> bool:
    n = next((n for n in plan.captured.graph_module.graph.nodes if n.name == name), None)
    return n is not None and n.op == "call_function" and n.target in (
        torch.ops.aten.linear.default, torch.ops.aten.matmul.default, torch.ops.aten.mm.default)


def _leaves(out):
    return [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]


def rank_pipeline(model, args, device: str = "ascend910b", level: str = "O3", backward: bool = False,
                  **fuse_kwargs) -> RankResult:
    """Steps 1–3 of the module docstring on this rank (torch.distributed initialised; every rank calls it with
    its shard of the same model, in the same order), and step 4 with ``backward``."""
    import torch.distributed as dist

    from autofuse.engine import AutoFusionEngine
    from autofuse.simulate import simulate_graph
    from autofuse.engine import generic_only
    from autofuse.report import GENERIC_BASELINE, baseline_label
    fused = AutoFusionEngine.fuse(model, tuple(args), target_device=device, optimization_level=level, **fuse_kwargs)
    plan = fused._require_plan()
    # the second baseline: the same model planned with every pattern family off (automatic discovery alone), run
    # through the same world simulation; every rank plans it, in the same order, as it does the plan
    switches = {**(fuse_kwargs.get("fusion_switches") or {}), **generic_only()}
    generic = AutoFusionEngine.fuse(model, tuple(args), target_device=device, optimization_level=level,
                                    **{**fuse_kwargs, "fusion_switches": switches})._require_plan()
    leaves = plan.captured.flatten_inputs(*args)
    unfused_sim = simulate_graph(plan.captured.graph_module, leaves, device)
    fused_sim = simulate_graph(plan.graph_module, leaves, device)
    generic_sim = simulate_graph(generic.graph_module, generic.captured.flatten_inputs(*args), device)
    decisions = list(plan.report.decisions)
    out_f = _leaves(fused_sim.outputs)
    out_u = _leaves(unfused_sim.outputs)
    diff = max(((a.double() - b.double()).abs().max().item() for a, b in zip(out_u, out_f)), default=0.0)
    res = RankResult(dist.get_rank(), device,
                     _run(fused_sim, plan.graph_module, decisions, plan, unfused_sim),
                     _run(unfused_sim, plan.captured.graph_module), decisions, diff,
                     plan.captured.unflatten_outputs(tuple(fused_sim.outputs)),
                     plan.captured.unflatten_outputs(tuple(unfused_sim.outputs)))
    res.generic = _run(generic_sim, generic.graph_module)
    res.generic_label = baseline_label(GENERIC_BASELINE, plan.report)
    if backward:
        _training_step(res, plan, leaves, device, generic)
    return res


def _training_step(res: RankResult, plan, leaves, device: str, generic=None):
    """Step 4 of the module docstring: both graphs' training steps on this rank, into ``res``."""
    from autofuse.simulate import simulate_graph
    # the rank's input requires grad, as a layer's inside a model does (its gradient is the previous layer's dy)
    xs = [x.detach().requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
          for x in leaves]
    fused = simulate_graph(plan.graph_module, xs, device, backward=True)
    unfused = simulate_graph(plan.captured.graph_module, xs, device, backward=True)
    res.step, res.step_unfused = _run(fused, fused.joint.graph_module), _run(unfused, unfused.joint.graph_module)
    if generic is not None:
        g = simulate_graph(generic.graph_module, xs, device, backward=True)
        res.step_generic = _run(g, g.joint.graph_module)
    joint, outs = fused.joint, list(fused.outputs)
    # the step's outputs: the forward's, then a gradient per parameter, then per input that requires grad
    end = len(outs) - sum(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)
    res.step_grads = {name: g for (name, _), g in zip(joint.params, outs[end - len(joint.params):end])}
    res.step_grad_outputs = joint.arguments(xs)[-len(joint.grad_shapes):]


def rank_builder(spec: str, hidden=None, heads=None, seq=None, batch=None, dtype="float32"):
    """A picklable ``build(rank, world_size) -> (module, example_args)`` for :func:`simulate_world`: ``"tp-block"``
    (:func:`autofuse.tp_models.build`, sized by the keywords given), or ``module:function`` /
    ``file.py:function`` naming such a function."""
    import functools
    if spec == "tp-block":
        from autofuse.tp_models import build
        sizes = {k: v for k, v in dict(hidden=hidden, heads=heads, seq=seq, batch=batch).items() if v is not None}
        return functools.partial(build, dtype=getattr(torch, dtype), **sizes)
    if ":" not in spec:
        raise ValueError(f"--world-size needs --model tp-block or module:function / file.py:function taking (rank, "
                         f"world_size); got {spec!r}")
    _function_of(spec)                  # checked here, once, not in every rank
    return functools.partial(_spec_build, spec)


def _function_of(spec: str):
    """The function ``module:function`` / ``file.py:function`` names, checked to take (rank, world_size)."""
    import importlib
    import inspect
    import runpy
    path, _, fn = spec.rpartition(":")
    ns = runpy.run_path(path) if path.endswith(".py") else vars(importlib.import_module(path))
    f = ns.get(fn)
    if not callable(f):
        raise ValueError(f"{path} has no function {fn!r} (a function (rank, world_size) -> (module, example_args))")
    try:
        inspect.signature(f).bind(0, 1)
    except TypeError:
        raise ValueError(f"{spec} must take (rank, world_size) and return (module, example_args); it is "
                         f"{fn}{inspect.signature(f)}") from None
    except ValueError:                  # a builtin without a signature: let the call say
        pass
    return f


def _spec_build(spec: str, rank: int, world: int):
    return _function_of(spec)(rank, world)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, build, device, level, backward, fuse_kwargs, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), AUTOFUSE_NPU_THREADS="1")
    torch.set_num_threads(1)           # several ranks share the host's cores
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, args = build(rank, world)
        # pickled here, by value: tensors handed over as shared memory vanish when this process ends
        queue.put((rank, pickle.dumps(rank_pipeline(model, args, device, level, backward, **fuse_kwargs)), None))
    except BaseException:           # the parent re-raises it with the rank named
        queue.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def simulate_world(build=None, world_size: int = 2, device: str = "ascend910b", level: str = "O3",
                   timeout: float = 1800.0, backward: bool = False, **fuse_kwargs) -> WorldResult:
    """Run :func:`rank_pipeline` on ``world_size`` gloo ranks (processes on this machine, loopback).

    ``build(rank, world_size) -> (module, example_args)`` must be picklable (a module-level function); it
    builds the rank's shard (default: :func:`autofuse.tp_models.build`, a Megatron-split GPT-2 block).
    ``fuse_kwargs`` go to every rank's ``AutoFusionEngine.fuse`` (``memory_budget``, ``fusion_switches``).
    ``backward``: also each rank's training step (step 4 of the module docstring).
    Returns every rank's result; the system's figures are the slowest rank's.
    """
    if build is None:
        from autofuse.tp_models import build
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker,
                         args=(r, world_size, port, build, device, level, backward, fuse_kwargs, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    for _ in range(world_size):
        rank, res, err = queue.get()
        if err:
            errors.append(f"rank {rank}:\n{err}")
        results[rank] = None if res is None else pickle.loads(res)
    for p in procs:
        p.join(timeout)
    if errors:
        raise RuntimeError("simulate_world failed on " + "\n".join(errors))
    return WorldResult(world_size, device, [results[r] for r in range(world_size)])


__all__ = ["CollectiveCost", "GraphRun", "RankResult", "WorldResult", "rank_builder", "rank_pipeline",
           "simulate_world"]
