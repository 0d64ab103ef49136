"""N simulated NPUs under torch.distributed: capture a tensor-parallel model on every rank, fuse its matmul +
collective pairs into MC2 kernels where the cost model says they pay, run it, and simulate every rank.

    from autofuse.distributed import simulate_world
    world = simulate_world(build, world_size=4, device="ascend910b")   # build(rank, world) -> (module, args)
    print(world.summary())             # per rank and system (slowest rank) cycles, decisions, collectives

Each rank is one process (``torch.multiprocessing``, gloo on loopback); each simulates its own chip. What
runs on a rank (:func:`run_rank`):

1. **capture** the rank's module with :func:`autofuse.capture.capture` (torch.export; the functional
   collectives appear as ``_c10d_functional.*`` + ``wait_tensor`` nodes);
2. **find** the matmul + collective pairs (:func:`patterns.mc2.find_mc2`);
3. **price** each with :func:`cost_model.mc2.choose_tiles` — fused at the best tile count, or kept unfused
   with the reason (every pair ends applied or rejected, as a :class:`Decision`);
4. **rewrite** the kept pairs to ``torch.ops.autofuse.*`` MC2 ops (:func:`rewrite_mc2`, a minimal fx rewrite);
5. **run** both graphs: values of the unfused graph by torch (the collectives through gloo), of the fused
   graph by the MC2 kernels (their data through gloo too);
6. **simulate** both graphs on the rank's NPU: collectives and MC2 ops by their simulator kernels (the
   link unit; peers' data and arrival times through gloo), every other node by
   :func:`autofuse.simulate.simulate_graph` on the graph with those nodes cut out (their values fed back
   in). A rank's time is the sum over its launches; the system's is the slowest rank's.

For each collective the result lists its bytes on the link, the link lane's busy cycles, its launch
cycles and what it overlapped with (nothing for a separate collective launch; for an MC2 op, the matmul
it is fused with, and the cycles that fusion hid by the cost model's unfused prices).

:func:`rank_pipeline` is the per-rank entry (``torch.distributed`` already initialised) and
:func:`simulate_world` the whole-world one (what ``autofuse simulate --world-size N`` can call).
"""
from __future__ import annotations

import operator
import os
import pickle
import socket
import traceback
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autofuse.graph import copy_graph_module, val
from autofuse.match import Match

c10d = torch.ops._c10d_functional
WAIT = c10d.wait_tensor.default
_COLLECTIVES = {c10d.all_reduce.default: "all_reduce", c10d.all_gather_into_tensor.default: "all_gather",
                c10d.reduce_scatter_tensor.default: "reduce_scatter", c10d.all_to_all_single.default: "all_to_all"}


def _mc2_ops():
    import autofuse.ops_mc2  # noqa: F401  (registers the ops)
    a = torch.ops.autofuse
    return {a.matmul_all_reduce.default: "matmul_all_reduce", a.matmul_reduce_scatter.default: "matmul_reduce_scatter",
            a.all_gather_matmul.default: "all_gather_matmul"}


@dataclass
class Decision:
    """One matmul + collective pair: fused (with its tile count) or kept unfused, and why."""

    kind: str
    nodes: tuple
    applied: bool
    reason: str
    tiles: int = 0
    cycles_fused: int = 0          # cost model
    cycles_unfused: int = 0        # cost model: the matmul and the collective, two launches


@dataclass
class CollectiveCost:
    node: str
    kind: str
    bytes: int                     # sent on the link by this rank
    link_cycles: int               # busiest lane's occupancy
    cycles: int                    # the launch (kernel time)
    overlapped_with: str           # "" for a collective launch of its own
    hidden_cycles: int = 0         # MC2: matmul + collective (cost model) minus the fused launch


@dataclass
class GraphRun:
    cycles: int
    graph_cycles: int              # the non-collective nodes (simulate_graph)
    collectives: list = field(default_factory=list)


@dataclass
class RankResult:
    rank: int
    device: str
    fused: GraphRun
    unfused: GraphRun
    decisions: list
    max_abs_diff: float            # fused graph's outputs vs the unfused graph's (both on this rank)
    outputs: object = None
    outputs_unfused: object = None

    @property
    def speedup(self) -> float:
        return self.unfused.cycles / self.fused.cycles if self.fused.cycles else 0.0


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
    def speedup(self) -> float:
        return self.cycles_unfused / self.cycles if self.cycles else 0.0

    def summary(self) -> str:
        from cost_model.devices import get_device
        clock = get_device(self.device).clock_hz
        lines = [f"{self.world_size} ranks on {self.device}: system {self.cycles:,} cycles "
                 f"({self.cycles / clock * 1e6:,.1f} µs) fused vs {self.cycles_unfused:,} unfused "
                 f"({self.speedup:.2f}x; slowest rank each)"]
        for r in self.ranks:
            lines.append(f"  rank {r.rank}: {r.fused.cycles:,} fused / {r.unfused.cycles:,} unfused cycles, "
                         f"outputs differ by {r.max_abs_diff:.3g}")
        for d in self.ranks[0].decisions:
            lines.append(f"  {'fused ' if d.applied else 'kept  '} {d.kind:22s} {', '.join(d.nodes)}: {d.reason}")
        for c in self.ranks[0].fused.collectives:
            ov = f", overlapped with {c.overlapped_with} (hid {c.hidden_cycles:,} cycles)" if c.overlapped_with else ""
            lines.append(f"  {c.kind:22s} {c.node}: {c.bytes:,} B on the link, link busy {c.link_cycles:,} of "
                         f"{c.cycles:,} cycles{ov}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------ planning
def _spec(n: fx.Node):
    v = val(n)
    return tuple(v.shape), str(v.dtype).replace("torch.", "")


def plan(gm: fx.GraphModule, matches: list[Match], device: str, tiles: int | None = None) -> list[Decision]:
    """Price every pair: fused at the cost model's best tile count (or ``tiles``), else kept with the reason."""
    from cost_model.mc2 import choose_tiles
    nodes = {n.name: n for n in gm.graph.nodes}
    out = []
    for m in matches:
        p = m.params
        if p["unsupported"]:
            out.append(Decision(m.pattern, m.nodes, False, f"unsupported: {p['unsupported']}"))
            continue
        x, w = nodes[m.inputs["x"]], nodes[m.inputs["weight"]]
        (xs, dt), (ws, _) = _spec(x), _spec(w)
        world = p["world_size"] or torch.distributed.get_world_size()
        counts = (tiles,) if tiles else None
        kw = {"counts": counts} if counts else {}
        pl = choose_tiles(m.pattern, (xs, dt), ((ws[1], ws[0]), dt), device, int(world), **kw)
        out.append(Decision(m.pattern, m.nodes, pl.tiles > 0, pl.reason, pl.tiles, pl.fused_cycles,
                            pl.unfused_cycles))
    return out


# ------------------------------------------------------------------------------------------ rewrite
def rewrite_mc2(gm: fx.GraphModule, matches: list[Match], decisions: list[Decision], device: str) -> fx.GraphModule:
    """A copy of ``gm`` in which every applied pair is one MC2 op call (``gm`` is left as it is)."""
    ops = {v: k for k, v in _mc2_ops().items()}
    new = copy_graph_module(gm)
    g = new.graph
    nodes = {n.name: n for n in g.nodes}
    for m, d in zip(matches, decisions):
        if not d.applied:
            continue
        p = m.params
        x, w, anchor = nodes[m.inputs["x"]], nodes[m.inputs["weight"]], nodes[m.anchor]
        with g.inserting_before(anchor):
            if m.pattern == "matmul_all_reduce":
                fused = g.call_function(ops[m.pattern], (x, w, "sum", p["group_name"], d.tiles, device))
                fused.meta["val"] = val(anchor)
                out, gathered = fused, None
            elif m.pattern == "matmul_reduce_scatter":
                fused = g.call_function(ops[m.pattern], (x, w, "sum", p["group_name"], int(p["world_size"]),
                                                         d.tiles, device))
                fused.meta["val"] = val(anchor)
                out, gathered = fused, None
            else:
                wait = nodes[m.nodes[1]]
                fused = g.call_function(ops[m.pattern], (x, w, p["group_name"], int(p["world_size"]), d.tiles,
                                                         device))
                fused.meta["val"] = (val(anchor), val(wait))
                out = g.call_function(operator.getitem, (fused, 0))
                out.meta["val"] = val(anchor)
                gathered = g.call_function(operator.getitem, (fused, 1))
                gathered.meta["val"] = val(wait)
        anchor.replace_all_uses_with(out)
        if gathered is not None:
            wait.replace_all_uses_with(gathered)
        for name in reversed(m.nodes):
            n = nodes[name]
            if n.graph is g and not n.users:
                g.erase_node(n)
    g.eliminate_dead_code()
    g.lint()
    new.recompile()
    return new


# ------------------------------------------------------------------------------------------ simulation
class _Comms(fx.Interpreter):
    """Runs a graph with every collective and MC2 op on the simulator (values from the kernels, peers through
    gloo); remembers each such node's value and launch statistics."""

    def __init__(self, gm, device):
        super().__init__(gm)
        self.device = device
        self.mc2 = _mc2_ops()
        self.values, self.stats = {}, {}

    def run_node(self, n):
        from autofuse import npu
        from autofuse import ops as fused_ops
        from autofuse.npu.link import GlooComm
        from torch.distributed.distributed_c10d import _resolve_process_group
        if n.op == "call_function" and n.target in _COLLECTIVES:
            args, _ = self.fetch_args_kwargs_from_env(n)
            kind = _COLLECTIVES[n.target]
            group = args[-1]
            kw = {}
            if kind == "all_to_all":
                kw = {"output_split_sizes": args[1], "input_split_sizes": args[2]}
            x = args[0]
            r = npu.run(kind, x, device=self.device, comm=GlooComm(_resolve_process_group(group)), **kw)
            value = r.torch_outputs()[0]
            self.values[n.name], self.stats[n.name] = value, (kind, r.stats)
            return value
        if n.op == "call_function" and n.target == WAIT:
            value = self.fetch_args_kwargs_from_env(n)[0][0]
            self.values[n.name] = value
            return value
        if n.op == "call_function" and n.target in self.mc2:
            with fused_ops.recording() as log:
                value = super().run_node(n)
            self.values[n.name], self.stats[n.name] = value, (self.mc2[n.target], log[-1][1])
            return value
        value = super().run_node(n)
        if n.op == "call_function" and n.target is operator.getitem and n.args[0].name in self.stats:
            self.values[n.name] = value
        return value


def _strip(gm: fx.GraphModule, cut: dict) -> fx.GraphModule:
    """A copy of ``gm`` whose nodes named in ``cut`` are placeholders (their values are fed in); the nodes that
    fed them stay."""
    new = copy_graph_module(gm)
    g = new.graph
    for n in list(g.nodes):
        if n.name in cut and n.op == "call_function":
            with g.inserting_before(n):
                ph = g.placeholder(f"cut_{n.name}")
            ph.meta["val"] = n.meta.get("val")
            n.replace_all_uses_with(ph)
            g.erase_node(n)
    new.recompile()          # no dead-code pass: what fed a cut node (its matmul) still runs and is priced
    return new


def simulate_rank(gm: fx.GraphModule, inputs: list, device: str, costs: dict | None = None):
    """(outputs, :class:`GraphRun`) of one forward pass of ``gm`` on this rank's simulated NPU."""
    from autofuse.simulate import simulate_graph
    runner = _Comms(gm, device)
    with torch.no_grad():
        outputs = runner.run(*inputs)
    cut = runner.values
    stripped = _strip(gm, cut)
    it = iter(inputs)
    feed = []
    for n in stripped.graph.nodes:
        if n.op == "placeholder":
            feed.append(cut[n.name[4:]] if n.name.startswith("cut_") and n.name[4:] in cut else next(it))
    sim = simulate_graph(stripped, feed, device)
    colls = []
    total = sim.cycles
    for name, (kind, st) in runner.stats.items():
        total += st.cycles
        hidden, with_ = 0, ""
        if costs is not None and name in costs:
            d, mm_node = costs[name]
            hidden, with_ = max(0, d.cycles_unfused - st.cycles), mm_node
        colls.append(CollectiveCost(name, kind, int(st.bytes.get("HBM->link", 0)), int(st.busy.get("link", 0)),
                                    int(st.cycles), with_, hidden))
    return outputs, GraphRun(total, sim.cycles, colls)


def rank_pipeline(model, args, device="ascend910b", tiles=None) -> RankResult:
    """Steps 1–6 of the module docstring on this rank (torch.distributed initialised, gloo)."""
    from autofuse.capture import capture
    from patterns.mc2 import find_mc2
    captured = capture(model, tuple(args), route="export")
    gm = captured.graph_module
    inputs = captured.flatten_inputs(*args)
    matches = find_mc2(gm)
    decisions = plan(gm, matches, device, tiles)
    fused_gm = rewrite_mc2(gm, matches, decisions, device)
    fused_nodes = [n for n in fused_gm.graph.nodes if n.op == "call_function" and n.target in _mc2_ops()]
    applied = [(m, d) for m, d in zip(matches, decisions) if d.applied]
    costs = {n.name: (d, m.nodes[0]) for n, (m, d) in zip(fused_nodes, applied)}
    out_u, run_u = simulate_rank(gm, inputs, device)
    out_f, run_f = simulate_rank(fused_gm, inputs, device, costs)
    leaves_u = [o for o in torch.utils._pytree.tree_leaves(out_u) if isinstance(o, torch.Tensor)]
    leaves_f = [o for o in torch.utils._pytree.tree_leaves(out_f) if isinstance(o, torch.Tensor)]
    diff = max(((a.double() - b.double()).abs().max().item() for a, b in zip(leaves_u, leaves_f)), default=0.0)
    rank = torch.distributed.get_rank()
    return RankResult(rank, device, run_f, run_u, decisions, diff, captured.unflatten_outputs(out_f),
                      captured.unflatten_outputs(out_u))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, build, device, tiles, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), AUTOFUSE_NPU_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, args = build(rank, world)
        # pickled here, by value: tensors handed over as shared memory vanish when this process ends
        queue.put((rank, pickle.dumps(rank_pipeline(model, args, device, tiles)), None))
    except BaseException:           # the parent re-raises it with the rank named
        queue.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def simulate_world(build=None, world_size: int = 2, device: str = "ascend910b", tiles: int | None = None,
                   timeout: float = 1800.0) -> WorldResult:
    """Run :func:`rank_pipeline` on ``world_size`` gloo ranks (processes on this machine, loopback).

    ``build(rank, world_size) -> (module, example_args)`` must be picklable (a module-level function); it
    builds the rank's shard (default: :func:`autofuse.tp_models.build`, a Megatron-split GPT-2 block).
    Returns every rank's result; the system's figures are the slowest rank's.
    """
    if build is None:
        from autofuse.tp_models import build
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, build, device, tiles, queue))
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


__all__ = ["CollectiveCost", "Decision", "GraphRun", "RankResult", "WorldResult", "plan", "rank_pipeline",
           "rewrite_mc2", "simulate_rank", "simulate_world"]
