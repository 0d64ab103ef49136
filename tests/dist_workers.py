"""Per-rank bodies of tests/test_distributed.py (module level, so that spawned ranks can import them)."""
import copy
import warnings

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.nn as nn
import torch.nn.functional as F

from autofuse import AutoFusionEngine
from autofuse.capture import CaptureError, capture
from autofuse.tp_models import TPBlock, build, example_input, make_block


class Pairs(torch.nn.Module):
    """One fusible pair of each kind and of each weight spelling, and near misses: a max all-reduce, a biased
    linear before the reduction, a matmul output read twice, a batched (3-D) weight. Every pair has its own
    weight, so that the canonical view's CSE does not merge pairs."""

    def __init__(self, k=32, n=48):
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def w(*shape):
            return torch.nn.Parameter(torch.randn(*shape, generator=g) / shape[-1] ** 0.5)

        self.w_ar, self.w_max, self.w_bias, self.w_twice, self.w_rs, self.w_ag = (w(n, k) for _ in range(6))
        self.w_kn, self.w_t = w(k, n), w(n, k)
        self.b = torch.nn.Parameter(torch.randn(n, generator=g))
        self.w3 = w(2, k, n)

    def forward(self, x):
        grp = dist.group.WORLD
        good = fc.all_reduce(F.linear(x, self.w_ar), "sum", grp)
        kn = fc.all_reduce(x @ self.w_kn, "sum", grp)                         # weight stored [K, N]
        mm = fc.all_reduce(torch.mm(x, self.w_t.t()), "sum", grp)            # x @ W.T spelled with mm
        mx = fc.all_reduce(F.linear(x, self.w_max), "max", grp)
        biased = fc.all_reduce(F.linear(x, self.w_bias, self.b), "sum", grp)
        y = F.linear(x, self.w_twice)
        twice = fc.all_reduce(y, "sum", grp) + y
        batched = fc.all_reduce(torch.matmul(x, self.w3), "sum", grp)
        rs = fc.reduce_scatter_tensor(F.linear(x, self.w_rs), "sum", 0, grp)
        ag = F.linear(fc.all_gather_tensor(x, 0, grp), self.w_ag)
        return good, kn, mm, mx, biased, twice, batched, rs, ag


class BigPair(torch.nn.Module):
    """A row-parallel linear too large for the 310P's fused kernel (its matmul gets half the UB)."""

    def __init__(self, k=8192, n=4096):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(n, k, dtype=torch.float16))

    def forward(self, x):
        return fc.all_reduce(F.linear(x, self.w), "sum", dist.group.WORLD)


class SPMLP(torch.nn.Module):
    """A Megatron sequence-parallel MLP shard: all-gather the rows, column-parallel linear, gelu, row-parallel
    linear, reduce-scatter the rows (an all_gather_matmul and a matmul_reduce_scatter pair)."""

    def __init__(self, world, h=64, f=256):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(f // world, h, generator=g) / h ** 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(h, f // world, generator=g) / f ** 0.5)

    def forward(self, x):
        grp = dist.group.WORLD
        hidden = F.gelu(F.linear(fc.all_gather_tensor(x, 0, grp), self.w1))
        return fc.reduce_scatter_tensor(F.linear(hidden, self.w2), "sum", 0, grp)


def sp_step(rank, world):
    """The sequence-parallel MLP's training step through rank_pipeline: its pairs, the step's launches on the
    links by phase, and the fused step's gradients against the eager shard's (float64 and float32; the same output
    gradient; torch's autograd of all_gather / reduce_scatter is the reduce-scatter / all-gather, Megatron's)."""
    from autofuse.distributed import rank_pipeline
    model = SPMLP(world)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(rank))     # rows enough for both pairs to pay
    res = rank_pipeline(model, (x,), device="ascend910b", fusion_switches=MC2_ONLY, backward=True)
    dy, = res.step_grad_outputs
    grads = {}
    for dt in (torch.float64, torch.float32):
        m = copy.deepcopy(model).to(dt)
        xs = x.to(dt).requires_grad_()
        m(xs).backward(dy.to(dt))
        grads[dt] = {"w1": m.w1.grad, "w2": m.w2.grad}
    return {"pairs": [(d.pattern, d.applied) for d in res.pairs],
            "links": [(c.kind, c.phase) for c in res.step.collectives],
            "links_unfused": [(c.kind, c.phase) for c in res.step_unfused.collectives],
            "cycles": (res.step.phases, res.step_unfused.phases),
            "grads": {k: ((g.double() - grads[torch.float64][k]).abs().max().item(),
                          (grads[torch.float32][k].double() - grads[torch.float64][k]).abs().max().item())
                      for k, g in ((k, res.step_grads[k]) for k in ("w1", "w2"))}}


def _decisions(fused):
    fams = ("matmul_all_reduce", "matmul_reduce_scatter", "all_gather_matmul")
    return [(d.pattern, d.anchor, d.applied, d.reason_code, d.reason, d.params.get("tiles"), dict(d.tiling))
            for d in fused.report.decisions if d.pattern in fams]


def _err(a, b):
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def checks(rank, world):
    """What one rank sees: capture targets, the engine's decisions on pairs and near misses, the whole
    pipeline on the Megatron block, the op's gradients."""
    from autofuse import AutoFusionEngine
    from autofuse.distributed import rank_pipeline
    out = {}
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    model = Pairs().eval()
    fused = AutoFusionEngine.fuse(model, (x,), target_device="ascend910b")
    captured = fused._require_plan().captured.graph_module
    out["targets"] = sorted({str(n.target) for n in captured.graph.nodes if "c10d" in str(n.target)})
    out["pairs"] = _decisions(fused)
    with torch.no_grad():
        want, got = model(x), fused(x)
        out["pairs_err"] = _err(want, got)
        # float32 eager against float64 on the same inputs: the bound the fused results are held to
        w64 = copy.deepcopy(model).double()(x.double())
        out["pairs_err_eager"] = _err(want, w64)
        out["pairs_err_fused"] = _err(got, w64)
    # a pair the cost model keeps unfused, planned on meta tensors (no data: pricing needs shapes only)
    with torch.device("meta"):
        big = BigPair()
    kept = AutoFusionEngine.fuse(big, (torch.empty(2048, 8192, dtype=torch.float16, device="meta"),),
                                 target_device="ascend310p")
    out["kept"] = _decisions(kept)
    # the whole pipeline on the Megatron block, through the engine
    block, args = build(rank, world)
    res = rank_pipeline(block, args, device="ascend910b", fusion_switches=MC2_ONLY, backward=True)
    out["step"] = _step_checks(res, rank, world)
    out["sp_step"] = sp_step(rank, world)
    ref64 = copy.deepcopy(make_block()).double()(example_input().double())
    with torch.no_grad():
        out["err_fused"] = (res.outputs.double() - ref64).abs().max().item()
        out["err_unfused"] = (block(*args).double() - ref64).abs().max().item()
    out["decisions"] = [(d.pattern, d.applied, d.reason_code) for d in res.pairs]
    out["cycles"] = (res.fused.cycles, res.unfused.cycles)
    out["collectives"] = [(cc.kind, cc.bytes, cc.link_cycles, cc.overlapped_with, cc.hidden_cycles)
                          for cc in res.fused.collectives]
    out["unfused_collectives"] = [(cc.kind, cc.bytes, cc.overlapped_with) for cc in res.unfused.collectives]
    out["fused_vs_unfused"] = res.max_abs_diff
    out["mc2_grads"] = mc2_grads(rank, world)
    # gradients of the fused op against the eager row-parallel linear (functional all-reduce, eager autograd)
    import autofuse.ops_mc2  # noqa: F401
    g = torch.Generator().manual_seed(10 + rank)
    xa = torch.randn(6, 16, generator=g, requires_grad=True)
    w = torch.randn(24, 16, generator=g, requires_grad=True)
    xe, we = xa.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    name = dist.group.WORLD.group_name
    y = torch.ops.autofuse.matmul_all_reduce(xa, w, "sum", name, 2, "ascend910b")
    y.pow(2).sum().backward()
    yb = fc.wait_tensor(fc.all_reduce(F.linear(xe, we), "sum", name))
    yb.pow(2).sum().backward()     # eager: the all-reduce's backward all-reduces the (replicated) gradient
    out["grad"] = max((xa.grad - xe.grad).abs().max().item(), (w.grad - we.grad).abs().max().item(),
                      (y - yb).abs().max().item())
    # torch.distributed.tensor.parallel: refused before any trace, naming DTensor and the functional form
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        parallelize_module(mlp, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
        capture(mlp, (torch.randn(4, 16),), route="export")
        out["dtensor"] = "captured"
    except CaptureError as e:
        out["dtensor"] = str(e)
    return out


def _step_checks(res, rank, world):
    """The simulated training step of the Megatron block on this rank: its phases and backward link launches, and
    the fused step's MLP weight gradients against the eager shard's (this rank's TPBlock under eager autograd, in
    float64 and float32, with the step's own output gradient; its all-reduces' backward all-reduce the gradient)."""
    names = ("fc1_w", "fc1_b", "fc2_w", "fc2_b")
    dy, = res.step_grad_outputs
    grads = {}
    for dt in (torch.float64, torch.float32):
        shard, (x,) = build(rank, world)       # the same shard afresh (its process group cannot be copied)
        shard.to(dt)(x.to(dt).requires_grad_()).backward(dy.to(dt))
        grads[dt] = {k: getattr(shard, k).grad for k in names}
    errs = {k: ((res.step_grads[k].double() - grads[torch.float64][k]).abs().max().item(),
                (grads[torch.float32][k].double() - grads[torch.float64][k]).abs().max().item()) for k in names}
    back = lambda run: [c.kind for c in run.collectives if c.phase == "backward"]   # noqa: E731
    return {"grads": errs, "phases": (res.step.phases, res.step_unfused.phases),
            "back_links": (back(res.step), back(res.step_unfused))}


# the tests are about the matmul + collective pairs: the attention family (its own tests) is switched off
MC2_ONLY = {"attention": "off"}


def tp_block_only(rank, world, dtype=torch.float32, grads=True):
    """The Megatron block through the engine on this rank, against the float64 single-device block (and, with
    ``grads``, :func:`mc2_grads` in this world)."""
    from autofuse.distributed import rank_pipeline
    block, args = build(rank, world, dtype=dtype)
    res = rank_pipeline(block, args, device="ascend910b", fusion_switches=MC2_ONLY)
    ref64 = copy.deepcopy(make_block(dtype=dtype)).double()(example_input(dtype=dtype).double())
    grad_checks = mc2_grads(rank, world) if grads else None
    with torch.no_grad():
        return {"err_fused": (res.outputs.double() - ref64).abs().max().item(),
                "err_unfused": (block(*args).double() - ref64).abs().max().item(),
                "decisions": [(d.pattern, d.applied, d.reason_code) for d in res.pairs],
                "cycles": (res.fused.cycles, res.unfused.cycles), "mc2_grads": grad_checks}


def tp_block_fp16(rank, world):
    return tp_block_only(rank, world, torch.float16, grads=False)


def _tp_layers(kind, x, w, name, p, variant=None):
    """The unfused TP layer in eager torch (functional collectives + linear), differentiable: its outputs. Each
    collective's backward is eager autograd's (torch 2.13: the functional all_reduce all-reduces the gradient;
    ``variant="inplace"``: c10d's in-place all_reduce, which autograd passes through unchanged)."""
    if kind == "all_gather_matmul":           # column-parallel, sequence-parallel input: reduce-scatter backward
        xg = fc.all_gather_single_autograd(x, 0, name)
        return F.linear(xg, w), xg
    if kind == "matmul_reduce_scatter":       # row-parallel, sequence-parallel output: all-gather backward
        return (fc.reduce_scatter_single_autograd(F.linear(x, w), "sum", 0, name),)
    y = F.linear(x, w)
    if variant == "inplace":
        with warnings.catch_warnings():       # c10d::allreduce_ has no autograd kernel: torch warns, identity
            warnings.simplefilter("ignore")
            dist.all_reduce(y, group=dist.group.WORLD)
        return (y,)
    return (fc.all_reduce(y, "sum", name),)


def _fused_layer(kind, x, w, name, p, variant=None):
    ops = torch.ops.autofuse
    if kind == "all_gather_matmul":
        return ops.all_gather_matmul(x, w, name, p, 2, "ascend910b")
    if kind == "matmul_reduce_scatter":
        return (ops.matmul_reduce_scatter(x, w, "sum", name, p, 2, "ascend910b"),)
    if variant == "inplace":
        return (ops.matmul_all_reduce(x, w, "sum", name, 2, "ascend910b", backward="identity"),)
    return (ops.matmul_all_reduce(x, w, "sum", name, 2, "ascend910b"),)     # the default: backward="all_reduce"


#: kind -> (x shape, w shape) on each rank: x [rows, K], w [N, K] (a linear's layout)
MC2_SHAPES = {"all_gather_matmul": ((8, 16), (24, 16)), "matmul_reduce_scatter": ((16, 16), (24, 16)),
              "matmul_all_reduce": ((6, 16), (24, 16))}


def mc2_grads(rank, world):
    """The MC2 ops' gradients (dx, dW) against the unfused TP layer's eager autograd, both measured against the
    float64 eager layer, for each op in float32 and float16 (all_gather_matmul also with its gathered output
    used and with dx only, matmul_reduce_scatter with dW only, matmul_all_reduce also against c10d's in-place
    all_reduce, ``backward="identity"``); and the launches each forward and backward
    records. Returns {(kind, dtype, variant): {"dx": (fused error, eager error), "dw": ..., "launches": [kernel
    names]}}, without the gradient a variant does not ask for."""
    from autofuse.ops import recording
    import autofuse.ops_mc2  # noqa: F401
    name, out = dist.group.WORLD.group_name, {}
    variants = [(k, None) for k in MC2_SHAPES] + [("all_gather_matmul", "gathered"), ("all_gather_matmul", "dx"),
                                                    ("matmul_reduce_scatter", "dw"), ("matmul_all_reduce", "inplace")]
    for dtype in (torch.float32, torch.float16):
        for kind, variant in variants:
            xs, ws = MC2_SHAPES[kind]
            g = torch.Generator().manual_seed(100 + rank)
            x, w = torch.randn(xs, generator=g), torch.randn(ws, generator=g) / ws[1] ** 0.5
            # each rank's own output gradient (a replicated output's may differ across ranks: each rank's loss)
            gy = torch.Generator().manual_seed(200 + rank)
            rows = {"all_gather_matmul": xs[0] * world, "matmul_reduce_scatter": xs[0] // world}.get(kind, xs[0])
            grads = [torch.randn(rows, ws[0], generator=gy), torch.randn(rows, xs[1], generator=gy)]
            if variant != "gathered":
                grads = grads[:1]
            want_x, want_w = variant != "dw", variant != "dx"

            def run(layer, dt):
                xl = x.to(dt).clone().requires_grad_(want_x)   # a copy: its .grad is this run's alone
                wl = w.to(dt).clone().requires_grad_(want_w)
                outs = layer(kind, xl, wl, name, world, variant)
                torch.autograd.backward(outs[:len(grads)], [d.to(dt) for d in grads])
                return xl.grad, wl.grad

            ref = run(_tp_layers, torch.float64)
            eager = run(_tp_layers, dtype)
            with recording() as log:
                fused = run(_fused_layer, dtype)
            res = {"launches": [k for k, _ in log]}
            for i, t in enumerate(("dx", "dw")):
                if ref[i] is not None:
                    res[t] = tuple((got.double() - ref[i]).abs().max().item() for got in (fused[i], eager[i]))
            out[(kind, str(dtype).replace("torch.", ""), variant)] = res
    return out


class Spelled(nn.Module):
    """One matmul + collective pair, written one of the ways a user writes it (``SPELLINGS``)."""

    def __init__(self, w, spelling):
        super().__init__()
        self.w, self.spelling = nn.Parameter(w.clone()), spelling

    def forward(self, x):
        grp, s = dist.group.WORLD, self.spelling
        if s == "all_reduce":                    # functional: autograd all-reduces the gradient
            return fc.all_reduce(F.linear(x, self.w), "sum", grp)
        if s == "all_reduce_inplace":            # c10d in place: eager autograd passes the gradient through
            y = F.linear(x, self.w)
            dist.all_reduce(y, group=grp)
            return y
        if s == "all_gather":
            return F.linear(fc.all_gather_tensor(x, 0, grp), self.w)
        if s == "reduce_scatter":
            return fc.reduce_scatter_tensor(F.linear(x, self.w), "sum", 0, grp)
        raise ValueError(s)


#: spelling -> the MC2 family it fuses to
SPELLINGS = {"all_reduce": "matmul_all_reduce", "all_reduce_inplace": "matmul_all_reduce",
             "all_gather": "all_gather_matmul", "reduce_scatter": "matmul_reduce_scatter"}


def spelling_grads(rank, world):
    """Each spelling of ``SPELLINGS`` fused through ``AutoFusionEngine.fuse`` and through
    ``torch.compile(backend="autofuse")``, and left unfused by a switch, trained one backward with a rank-dependent output gradient, against the
    same module in eager autograd: {(spelling, route): {"applied": [...], "dx": err, "dw": err, "scale": ...}}
    (errors relative to the largest eager gradient entry)."""
    from autofuse.backend import reports
    out = {}
    g = torch.Generator().manual_seed(0)
    w_full, x_full = torch.randn(24, 32, generator=g) / 6, torch.randn(16, 32, generator=g)
    for spelling, family in SPELLINGS.items():
        if family == "all_gather_matmul":       # rows split over the ranks, the whole weight
            w, x = w_full, x_full.chunk(world)[rank].contiguous()
        else:                                   # row-parallel: this rank's slice of K
            w, x = w_full.chunk(world, 1)[rank].contiguous(), x_full.chunk(world, 1)[rank].contiguous()

        def step(module, call):
            xs = x.clone().requires_grad_()
            with warnings.catch_warnings():     # eager c10d::allreduce_: no autograd kernel (a warning)
                warnings.simplefilter("ignore")
                y = call(xs)
                dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(300 + rank))
                y.backward(dy)
            return xs.grad, module.w.grad

        eager = Spelled(w, spelling)
        want = step(eager, eager)
        scale = max(t.abs().max().item() for t in want)
        for route in ("fuse", "compile", "unfused"):
            m = Spelled(w, spelling)
            if route != "compile":              # "unfused": the pair switched off, the collective as captured
                fused = AutoFusionEngine.fuse(m, (x,), target_device="ascend910b",
                                              fusion_switches={family: "off"} if route == "unfused" else None)
                got = step(m, fused)
                decisions = fused.report.decisions
            else:
                compiled = torch.compile(m, backend="autofuse")
                got = step(m, compiled)
                decisions = [d for r in reports(compiled) for d in r.decisions]
                torch._dynamo.reset()
            out[(spelling, route)] = {
                "applied": [(d.pattern, d.applied, d.params.get("backward")) for d in decisions
                            if d.pattern == family],
                "dx": (got[0] - want[0]).abs().max().item() / scale,
                "dw": (got[1] - want[1]).abs().max().item() / scale}
    return out


__all__ = ["MC2_SHAPES", "Pairs", "SPELLINGS", "SPMLP", "Spelled", "TPBlock", "checks", "mc2_grads", "spelling_grads",
           "tp_block_fp16", "tp_block_only"]


def ddp_steps(rank, world):
    """Three SGD steps of DistributedDataParallel over the fused module against DDP over an eager copy (dropout on,
    the same seeds), and what fuse() says of the wrapper itself."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 16)).train()
    eager = copy.deepcopy(model)
    xs = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(rank))
    fused, ref = DDP(AutoFusionEngine.fuse(model, (xs[0],))), DDP(eager)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    losses = []
    for step in range(3):
        pair = []
        for run, opt in zip((fused, ref), opts):
            torch.manual_seed(10 + step + rank)
            loss = run(xs[step]).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            pair.append(loss.item())
        losses.append(pair)
    try:
        AutoFusionEngine.fuse(DDP(copy.deepcopy(eager)), (xs[0],))
        refused = None
    except TypeError as e:
        refused = str(e)
    return {"losses": losses, "fused": bool(fused.module.report.applied), "refused": refused,
            "param_diff": max((a - b).abs().max().item() for a, b in zip(model.parameters(), eager.parameters()))}



class RowParallel(nn.Module):
    """A row-parallel linear and its all-reduce, on this rank's shard of the weight."""

    def __init__(self, w):
        super().__init__()
        self.w = nn.Parameter(w)

    def forward(self, x):
        return fc.all_reduce(F.linear(x, self.w), "sum", dist.group.WORLD)


def _mc2_decision(fused):
    d, = [d for d in fused.report.decisions if d.pattern == "matmul_all_reduce"]
    return d.applied, d.reason_code, d.reason, d.tiling.get("tiles")


def agreement_checks(rank, world):
    """Ranks whose own plans of an MC2 pair differ: uneven shards (5 heads of 64 over 2 ranks: K 192 / 128, 16
    tokens; alone, rank 0 prices 1 tile best and rank 1 4 tiles), then rank 0 alone planning again (a transposed
    input of the same values), then a switch, a memory budget and a level given to rank 1 only. Each: the decision
    on this rank, and the fused output's largest difference from eager's on the same inputs (two calls)."""
    from cost_model.mc2 import choose_tiles
    out = {}
    g = torch.Generator().manual_seed(0)
    k0, k1, n, m = 192, 128, 64, 16
    W, X = torch.randn(n, k0 + k1, generator=g) / 16, torch.randn(m, k0 + k1, generator=g)
    sl = slice(0, k0) if rank == 0 else slice(k0, k0 + k1)
    model, x = RowParallel(W[:, sl].clone()), X[:, sl].contiguous()
    k = x.shape[1]
    out["own_tiles"] = choose_tiles("matmul_all_reduce", ((m, k), "float32"), ((k, n), "float32"), "ascend910b",
                                    world).best_tiles
    fused = AutoFusionEngine.fuse(model, (x,), target_device="ascend910b")
    out["uneven"] = _mc2_decision(fused)
    with torch.no_grad():
        out["uneven_err"] = max((fused(x) - model(x)).abs().max().item() for _ in range(2))
        # rank 0 alone: a new input layout plans again there (the other rank's plan serves it): no collective
        xt = x.t().contiguous().t() if rank == 0 else x
        out["replan_err"] = max((fused(xt) - model(xt)).abs().max().item() for _ in range(2))
    out["plans"] = len(fused.plans)
    out["replan"] = [_mc2_decision_of(p.report) for p in fused.plans.values()]
    W = torch.randn(64, 64, generator=g) / 8
    xe, xc = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)
    sl = slice(rank * 32, (rank + 1) * 32)
    model = RowParallel(W[:, sl].clone())
    for mode, kw in (("switch", {"fusion_switches": {"matmul_all_reduce": "off"}}),
                     ("budget", {"memory_budget": "2KB"}), ("level", {"optimization_level": "O0"})):
        fused = AutoFusionEngine.fuse(model, (xe[:, sl].contiguous(),), target_device="ascend910b",
                                      **(kw if rank == 1 else {}))
        with torch.no_grad():
            err = max((fused(xc[:, sl].contiguous()) - model(xc[:, sl].contiguous())).abs().max().item()
                      for _ in range(2))
        out[mode] = _mc2_decision(fused) + (err,)
    return out


def _mc2_decision_of(report):
    d, = [d for d in report.decisions if d.pattern == "matmul_all_reduce"]
    return d.applied, d.reason_code, d.tiling.get("tiles")


def fsdp2_checks(rank, world):
    """What autofuse says of FSDP2 (fully_shard) either way round, and of DTensor tensor parallelism through
    torch.compile (the graph runs unfused, with a warning)."""
    import warnings
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 16))

    out = {}
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    sharded = mlp()
    fully_shard(sharded)
    try:
        AutoFusionEngine.fuse(sharded, (x,))
        out["fuse_of_fsdp2"] = None
    except Exception as e:      # noqa: BLE001 - the message is the result
        out["fuse_of_fsdp2"] = f"{type(e).__name__}: {e}"
    fused = AutoFusionEngine.fuse(mlp(), (x,))
    fully_shard(fused)
    try:
        fused(x)
        out["fsdp2_of_fused"] = None
    except Exception as e:      # noqa: BLE001
        out["fsdp2_of_fused"] = f"{type(e).__name__}: {e}"
    tp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    parallelize_module(tp, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch._dynamo.reset()
        y = torch.compile(tp, backend="autofuse")(x)
    out["compiled_err"] = (y - tp(x)).abs().max().item()
    out["compile_warnings"] = [str(w.message) for w in caught if "autofuse" in str(w.message)]
    return out
