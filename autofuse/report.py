"""Reports people read: the text summary, Markdown, and one self-contained HTML page per plan.

The page opens with the verdict and then explains it:

1. **Verdict**: the whole model's speed-up against each baseline given (today "eager op by op"; any number
   of named baselines render, so "generic fusion alone" slots in), *simulated* when simulations are given
   (the NPU simulator counted every launch) or *predicted* by the cost model otherwise;
2. **memory**: peak activation memory unfused and fused, against the budget;
3. **what was fused and what was not, and why**: counts per reason code with the code's meaning;
4. **per-family tables**: every candidate with its numbers (candidates with equal figures, a layer's
   block repeated, share a row that lists their anchors);
5. **roofline** of the kernels (matplotlib, inline SVG): FLOPs per HBM byte against attained FLOP/s, under
   the device's Cube, Vector and HBM ceilings;
6. **per-layer time**: cycles grouped by the model's module hierarchy (:mod:`autofuse.hierarchy`), identical
   layers folded into one row;
7. the graphs before and after (from :mod:`autofuse.viz`) when given.

Per-node figures come from :func:`node_costs`: the simulator's counts when a simulation is given, else the
cost model's prices of the kernels each node lowers to (the table the planner and simulator share,
:mod:`autofuse.lower`); a fused op is priced as the planner priced it (its decision). The page has no
external resources: CSS, the plot and a few lines of JavaScript (sortable tables) are inline.
"""
from __future__ import annotations

import html
import io
import re
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autofuse import decision as _decision
from autofuse import hierarchy
from autofuse.lower import lower, step_specs
from cost_model.devices import get_device

#: Reason code -> what it means, read from the table in :mod:`autofuse.decision` (one source of truth).
REASONS = dict(re.findall(r"^``(\w+)``\s+(.+)$", _decision.__doc__ or "", re.M))

#: Fill colours of fusion families (fused regions, fused ops, the legend); others get a colour from FALLBACK.
#: One colour per family, and per named kind of generated region (the norms share one, the gated units one)
FAMILY_COLOURS = {"attention": "#4e9a06", "softmax": "#ce5c00", "rope": "#c4a000", "moe_gating": "#ad7fa8",
                  "moe_experts": "#75507b", "rms_norm": "#3465a4", "add_rms_norm": "#3465a4", "layer_norm": "#3465a4",
                  "swiglu": "#06989a", "geglu": "#06989a", "matmul_epilogue": "#5c3566", "vector_chain": "#888a85",
                  "all_gather_matmul": "#a40000", "matmul_reduce_scatter": "#a40000", "matmul_all_reduce": "#a40000"}
FALLBACK = ("#8f5902", "#204a87", "#2e3436")      # none of the above
BASELINE = "eager op by op"
#: The second baseline: this plan's level and switches with every pattern family switched off
GENERIC_BASELINE = "generic fusion alone"


def baseline_label(name: str, report) -> str:
    """A baseline's name as reports print it. Generic fusion alone is planned at the report's level and under its
    switches (what the pattern families add on top of discovery, as the user configured both): where those are
    not the defaults (O3, no switches) the label says so, e.g. ``generic fusion alone at O0`` (which fuses
    nothing: it is eager op by op)."""
    if name != GENERIC_BASELINE or report is None:
        return name
    level = getattr(report, "optimization_level", "O3")
    return (name + (f" at {level}" if level != "O3" else "")
            + (" under the same switches" if getattr(report, "fusion_switches", None) else ""))


def family_colour(family: str) -> str:
    """The colour of a family or a region's name; a joined name (``matmul+swiglu``, ``add_rms_norm+matmul``) takes
    its first part that is not the matmul."""
    parts = [p for p in family.split("+") if p != "matmul"] or [family]
    return FAMILY_COLOURS.get(family) or FAMILY_COLOURS.get(parts[0]) or \
        FALLBACK[sum(map(ord, family)) % len(FALLBACK)]


# ---------------------------------------------------------------------------------------------- figures

@dataclass
class Cost:
    """What one node costs: ``source`` says whether the simulator counted it or the cost model predicted it."""

    cycles: int
    hbm_bytes: int
    bound: str
    flops: float = 0.0
    kernels: tuple = ()
    source: str = "predicted"
    fused: str = ""                  # the fusion family of a fused op
    part_of: str = ""                # a fused op's other launch: the lead call whose price includes it


def _spec(n):
    v = n.meta.get("val")
    return tuple(v.shape), str(v.dtype).replace("torch.", "")


def kernel_estimates(node: fx.Node, device: str) -> list:
    """The cost model's :class:`~cost_model.Estimate` of each kernel ``node`` lowers to (none for views), priced as
    the planner prices it (:func:`autofuse.plan.estimate_kernel`), so that the per-node figures add up to the
    report's."""
    from autofuse.plan import estimate_kernel          # the planner builds on this module's neighbours
    prog = lower(node)
    out = []
    for st, (ins, spec_out) in zip(prog.steps, step_specs(prog, node)):
        params = {k: (_spec(prog.inputs[v.i]) if hasattr(v, "i") else v) for k, v in st.params.items()}
        if st.kernel == "generic":
            params = {"outputs": [spec_out]}
        out.append(estimate_kernel(st.kernel, ins, device, params))
    return out


def node_costs(gm: fx.GraphModule, device: str, report=None, simulation=None, before: dict | None = None) -> dict:
    """Node name -> :class:`Cost` for every node that launches a kernel (see the module docstring).

    ``report`` prices fused ops (their decisions); ``before``: the costs of the graph before the rewrite, whose
    FLOPs a fused op inherits (it does the same arithmetic)."""
    # a fused call is an applied decision's (rejected ones may share its anchor: another candidate there)
    decisions = {d.anchor: d for d in (report.applied if report is not None else ())}
    simulated = {c.node: c for c in (simulation.nodes if simulation is not None else ())}
    out = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        match = hierarchy.fused_match(n)
        lead = hierarchy.fused_part_of(n)
        if lead:
            # another launch of a fused op (or a view of its outputs): the decision's price, charged to the lead,
            # already holds it
            d = decisions.get(hierarchy.fused_block(n)[0])
            cost = Cost(0, 0, d.bound_fused if d is not None else "", 0.0, (), fused=match.pattern, part_of=lead) \
                if not lower(n).free else None
        elif match is not None:
            anchor, block = hierarchy.fused_block(n)
            d = decisions.get(anchor)
            flops = sum(before[x].flops for x in block if x in before) if before else 0.0
            cost = Cost(d.cycles_fused, d.hbm_bytes_fused, d.bound_fused, flops, (d.kernel or match.pattern,),
                        fused=match.pattern) if d is not None else None
        else:
            est = kernel_estimates(n, device)
            cost = Cost(sum(int(e.cycles) for e in est), sum(int(e.hbm_bytes) for e in est),
                        max(est, key=lambda e: e.cycles).bound, sum(e.flops for e in est),
                        tuple(e.kernel for e in est)) if est else None
        sim = simulated.get(n.name)
        if sim is not None:
            cost = Cost(sim.cycles, sim.hbm_bytes, sim.bound, cost.flops if cost else 0.0, tuple(sim.kernels),
                        "simulated", match.pattern if match is not None else "")
        if cost is not None:
            out[n.name] = cost
    return out


@dataclass
class Verdict:
    """The whole model's cycles fused and under each named baseline."""

    device: str
    fused_cycles: int
    baselines: dict                      # name -> cycles
    source: str                          # "simulated" or "predicted"

    def speedups(self) -> dict:
        return {k: v / max(self.fused_cycles, 1) for k, v in self.baselines.items()}

    def seconds(self, cycles) -> float:
        return cycles / get_device(self.device).clock_hz


def verdict(device: str, before_costs: dict, after_costs: dict, simulations: dict | None = None,
            extra_baselines: dict | None = None) -> Verdict:
    """Simulated when ``simulations`` has ``"fused"`` and baseline entries (name -> SimulationResult), else the
    sums of the predicted node costs. ``extra_baselines``: name -> cycles, for baselines measured elsewhere."""
    if simulations and "fused" in simulations:
        base = {k: s.cycles for k, s in simulations.items() if k != "fused"}
        v = Verdict(device, simulations["fused"].cycles, base, "simulated")
    else:
        v = Verdict(device, sum(c.cycles for c in after_costs.values()),
                    {BASELINE: sum(c.cycles for c in before_costs.values())}, "predicted")
    v.baselines.update(extra_baselines or {})
    return v


def reason_counts(report) -> list:
    """``(code, count, meaning)`` for every reason code that occurs, most frequent first."""
    counts = Counter(d.reason_code for d in report.decisions)
    return [(code, n, REASONS.get(code, "")) for code, n in counts.most_common()]


@dataclass
class LayerRow:
    """One row of the per-layer breakdown: a layer, or ``count`` identical consecutive ones folded together."""

    path: tuple
    cls: str
    unfused: int                         # cycles of one layer
    fused: int
    children: list = field(default_factory=list)    # (child name, unfused, fused) of one layer
    count: int = 1

    @property
    def name(self) -> str:
        name = ".".join(self.path) or "(top level)"
        return name if self.count == 1 else f"{name} … {int(self.path[-1]) + self.count - 1}"


def layer_rows(before: fx.GraphModule, after: fx.GraphModule, before_costs: dict, after_costs: dict) -> list:
    """Cycles per layer (:func:`autofuse.hierarchy.layer_of`) in graph order; consecutive siblings
    (``layers.3`` after ``layers.2``) with equal cycles before and after are folded into one row."""
    paths_b = hierarchy.module_paths(before)
    paths_a = hierarchy.module_paths(after, before=paths_b)
    classes = hierarchy.module_classes(before, after)
    sums: dict = {}                      # layer -> {child: [unfused, fused]}, in first-seen order
    for side, gm, paths, costs in ((0, before, paths_b, before_costs), (1, after, paths_a, after_costs)):
        for n in gm.graph.nodes:
            if n.name in costs:
                path = paths.get(n.name, ())
                layer = hierarchy.layer_of(path)
                kid = sums.setdefault(layer, {}).setdefault(path[len(layer):len(layer) + 1], [0, 0])
                kid[side] += costs[n.name].cycles
    rows: list[LayerRow] = []
    for layer, kids in sums.items():
        unfused, fused = sum(k[0] for k in kids.values()), sum(k[1] for k in kids.values())
        prev = rows[-1] if rows else None
        if (prev is not None and layer[:-1] == prev.path[:-1] and layer and layer[-1].isdigit()
                and prev.path[-1].isdigit() and int(layer[-1]) == int(prev.path[-1]) + prev.count
                and (prev.unfused, prev.fused) == (unfused, fused)):
            prev.count += 1
            continue
        children = [(".".join(k) or "(own ops)", u, f) for k, (u, f) in kids.items()]
        rows.append(LayerRow(layer, classes.get(layer, ""), unfused, fused, children))
    return rows


# ---------------------------------------------------------------------------------------------- text

#: what a training plan means, where a report says it is one
TRAINING_NOTE = ("the model is in train(): a dropout draws eager's keep-mask, fused or not, and fused blocks keep what "
                 "their backward reads; call model.eval() for an inference plan")


def _whole_graph(report) -> str:
    """The whole graph's predicted cycles and its speed-up against each baseline (text and Markdown say it alike)."""
    return _cycles_against(report.predicted_cycles, {baseline_label(k, report): v for k, v in report.baselines.items()})


def _cycles_against(fused: int, baselines: dict) -> str:
    return f"{fused:,} cycles; " + ", ".join(f"{v / max(fused, 1):.2f}x vs {k} ({v:,})" for k, v in baselines.items())


def simulated_whole_graph(simulations: dict, report=None) -> str:
    """The whole graph's simulated cycles and its speed-up against each simulated baseline, as
    :func:`_whole_graph` says the predicted ones; ``simulations``: ``{"fused": SimulationResult, baseline name:
    SimulationResult, ...}``; ``report``: the plan's, whose level and switches label the generic baseline."""
    return _cycles_against(simulations["fused"].cycles,
                           {baseline_label(k, report): s.cycles for k, s in simulations.items() if k != "fused"})


def text_summary(report) -> str:
    a, r = report.applied, report.rejected
    lines = [f"autofuse plan for {report.device} at {report.optimization_level}: {len(a)} fused, {len(r)} not fused "
             f"({report.nodes_before} -> {report.nodes_after} graph nodes)"]
    if a:
        before = sum(d.cycles_unfused for d in a)
        after = sum(d.cycles_fused for d in a)
        saved = sum(d.hbm_bytes_saved for d in a)
        lines.append(f"  fused blocks: {before:,} -> {after:,} cycles ({before / max(after, 1):.2f}x), "
                     + (f"HBM saved {saved:,} B" if saved >= 0 else f"HBM traffic {-saved:,} B more"))
    if report.baselines:
        lines.append(f"  whole graph (predicted): {_whole_graph(report)}")
    width = max([10] + [len(d.pattern) for d in report.decisions])
    at = max([24] + [len(d.anchor) for d in report.decisions])
    for d in report.decisions:
        mark = "FUSED " if d.applied else "kept  "
        fused = f"{d.shown()['cycles_fused']:>12}"
        lines.append(f"  {mark}{d.pattern:<{width}} at {d.anchor:<{at}} {d.reason_code:<22} "
                     f"{d.cycles_unfused:>12,} -> {fused} cycles  {d.reason}")
    if report.memory_budget is not None:
        lines.append(f"  peak activation memory: {report.peak_memory_unfused:,} B unfused, "
                     f"{report.peak_memory_fused:,} B fused; budget {report.memory_budget:,} B")
    if report.training:
        lines.append(f"  planned for training mode ({TRAINING_NOTE})")
    if report.guards:
        lines.append(f"  re-planned if these change: {'; '.join(report.guards)}")
    if report.replanned_because:
        lines.append(f"  re-planned because {report.replanned_because}")
    lines.extend(f"  warning: {w}" for w in report.warnings)
    return "\n".join(lines)


def implementation_rows(report) -> list:
    """``(region, anchor, device, chosen implementation, its cycles, the others as text)`` for every applied
    decision that priced alternatives (``params["alternatives"]``: device -> [(implementation, cycles, runnable)],
    cheapest first); identical regions (same name and alternatives) are listed once, with their first anchor."""
    rows, seen = [], set()
    for d in report.applied:
        alts = d.params.get("alternatives")
        if not alts:
            continue
        key = (d.pattern, repr(alts))
        if key in seen:
            continue
        seen.add(key)
        for device, options in alts.items():
            runnable = [o for o in options if o[2]]
            if not runnable:
                continue
            chosen = runnable[0]
            others = ", ".join(f"{o[0]} {o[1]:,}" + ("" if o[2] else " (priced only)")
                               for o in options if o is not chosen)
            rows.append((d.pattern, d.anchor, device, chosen[0], chosen[1], others or "-"))
    return rows


def markdown(report, simulations: dict | None = None) -> str:
    """The report as Markdown; ``simulations`` (``{"fused": ..., baseline name: ...}``, SimulationResults) add the
    simulated verdict under the predicted one."""
    out = [f"# autofuse report: {report.device}, {report.optimization_level}", "",
           f"{len(report.applied)} fused, {len(report.rejected)} not fused; graph {report.nodes_before} -> "
           f"{report.nodes_after} nodes.", ""]
    if report.baselines:
        out += [f"Whole graph (predicted): {_whole_graph(report)}.", ""]
    if simulations and "fused" in simulations:
        out += [f"Whole graph (simulated on {simulations['fused'].device}): "
                f"{simulated_whole_graph(simulations, report)}.", ""]
    if report.training:
        out += [f"Planned for training mode ({TRAINING_NOTE}).", ""]
    out += ["| | pattern | anchor | reason | unfused cycles | fused cycles | speed-up | HBM saved (B) "
           "| working set (B) | of it workspace (B) |",
           "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for d in report.decisions:
        f = d.shown()
        out.append(f"| {'fused' if d.applied else 'kept'} | {d.pattern} | `{d.anchor}` | {d.reason_code}: "
                   f"{d.reason} | {d.cycles_unfused:,} | {f['cycles_fused']} | {f['speedup']} | "
                   f"{f['hbm_bytes_saved']} | {d.working_set_bytes:,} | {d.workspace_bytes:,} |")
    choices = implementation_rows(report)
    if choices:
        out += ["", "## Implementation choices per device", "",
                "Each fused region's implementations priced on every device profile; the chosen one is the "
                "cheapest this kernel can run (the others marked priced only have no kernel here: they show what "
                "the choice is worth).", "",
                "| region | anchor | device | chosen | cycles | other implementations (cycles) |",
                "|---|---|---|---|---:|---|"]
        for name, anchor, device, chosen, cycles, others in choices:
            out.append(f"| {name} | `{anchor}` | {device} | {chosen} | {cycles:,} | {others} |")
    if report.memory_budget is not None or report.peak_memory_unfused:
        out += ["", f"Peak activation memory: {report.peak_memory_unfused:,} B unfused, "
                    f"{report.peak_memory_fused:,} B fused"
                    + (f" (budget {report.memory_budget:,} B)." if report.memory_budget is not None else ".")]
    if report.guards:
        out += ["", f"Re-planned if these change: {'; '.join(report.guards)}."]
    if report.replanned_because:
        out += ["", f"Re-planned because {report.replanned_because}."]
    out += [f"- warning: {w}" for w in report.warnings]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- roofline

def _main_dtype(costs_gm: fx.GraphModule) -> str:
    counts = Counter(str(v.dtype).replace("torch.", "") for n in costs_gm.graph.nodes
                     if isinstance(v := n.meta.get("val"), torch.Tensor) and v.is_floating_point())
    return counts.most_common(1)[0][0] if counts else "float16"


def roofline_svg(device: str, dtype: str, before_costs: dict, after_costs: dict) -> str:
    """The kernels on a roofline (log-log): unfused kernels hollow, fused ones filled in their family's colour,
    area proportional to their cycles. Returns inline SVG text ("" when no kernel does arithmetic)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dev = get_device(device)
    hz = dev.clock_hz
    pts = [(c, False) for c in before_costs.values()] + [(c, True) for c in after_costs.values() if c.fused]
    pts = [(c, f) for c, f in pts if c.flops > 0 and c.hbm_bytes > 0 and c.cycles > 0]
    if not pts:
        return ""
    cube = dev.cube_peak_flops(dtype if dtype in dev.cube_macs else "float16")
    vector = dev.vector_lanes(dtype if dtype in ("float16", "bfloat16", "float32") else "float16") \
        * dev.vector_cores * hz
    hbm = dev.hbm_bytes_per_cycle * hz
    xs = [c.flops / c.hbm_bytes for c, _ in pts]
    lo, hi = min(xs + [1.0]) / 4, max(xs + [cube / hbm]) * 4
    plt.rcParams["svg.fonttype"] = "none"
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=100)
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [min(cube, x * hbm) / 1e12 for x in grid], color="#333", lw=1.5, label="Cube peak / HBM")
    ax.plot(grid, [min(vector, x * hbm) / 1e12 for x in grid], color="#999", lw=1, ls="--", label="Vector peak")
    longest = max(c.cycles for c, _ in pts)
    groups: dict = {}                # identical kernels (a layer repeated) are one point: same place, same size
    for c, fused in pts:
        key = (c.fused if fused else "", c.flops / c.hbm_bytes, c.flops / (c.cycles / hz) / 1e12,
               15 + 260 * c.cycles / longest)
        groups[key] = groups.get(key, 0) + 1
    for fam in sorted({k[0] for k in groups}):
        xs, ys, ss = zip(*[k[1:] for k in groups if k[0] == fam])
        if fam:
            ax.scatter(xs, ys, s=ss, color=family_colour(fam), edgecolor="black", lw=0.6, zorder=3,
                       label=f"fused {fam}")
        else:
            ax.scatter(xs, ys, s=ss, facecolor="none", edgecolor="#3465a4", lw=0.8, zorder=2, label="unfused kernel")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per HBM byte)")
    ax.set_ylabel("attained TFLOP/s")
    ax.set_title(f"{dev.name}, {dtype}: kernels on the roofline (area = cycles)", fontsize=10)
    ax.grid(True, which="major", color="#eee")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    plt.close(fig)
    svg = buf.getvalue()
    return svg[svg.index("<svg"):]


# ---------------------------------------------------------------------------------------------- HTML

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:1180px;padding:0 18px 40px;
color:#222;line-height:1.4}
h1{font-size:1.5em;margin:18px 0 4px}h2{font-size:1.2em;margin-top:28px;border-bottom:1px solid #ddd}
.meta{color:#666;font-size:.9em}
.verdict{display:flex;gap:18px;flex-wrap:wrap;margin:14px 0}
.card{border:1px solid #ccc;border-radius:8px;padding:10px 16px;min-width:230px;background:#fafafa}
.card .big{font-size:2.2em;font-weight:700}.card.win .big{color:#2e7d32}.card.loss .big{color:#c62828}
.card .sub{color:#555;font-size:.85em}
table{border-collapse:collapse;margin:6px 0;font-size:.88em}
td,th{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f3f3f3;cursor:pointer;user-select:none}td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
tr.applied td:first-child{color:#2e7d32;font-weight:600}tr.rejected td:first-child{color:#b26a00;font-weight:600}
.bar{display:inline-block;height:10px;background:#3465a4;vertical-align:middle}
.bar.f{background:#4e9a06}.swatch{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:4px;
vertical-align:middle}
.graph{overflow:auto;border:1px solid #ddd;max-height:900px;background:#fff}.graph svg{max-width:none}
code{background:#f3f3f3;padding:0 3px;border-radius:3px}.warn{color:#b26a00}
details summary{cursor:pointer;color:#204a87}
"""

_JS = """
document.querySelectorAll('table.sortable th').forEach(function (th) {
  th.addEventListener('click', function () {
    var i = th.cellIndex, table = th.closest('table'), body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    var desc = th.dataset.dir !== 'desc';
    th.dataset.dir = desc ? 'desc' : 'asc';
    // numbers by value, then words ("fused elsewhere", "n/a") by text: the words after the numbers either way
    var key = function (r) {
      var t = r.cells[i].dataset.v || r.cells[i].textContent;
      var x = parseFloat(t.replace(/[,x%]/g, ''));
      return isNaN(x) ? [1, t] : [0, x];
    };
    rows.sort(function (a, b) {
      var x = key(a), y = key(b);
      if (x[0] !== y[0]) return x[0] - y[0];
      return (x[1] < y[1] ? -1 : x[1] > y[1] ? 1 : 0) * (desc ? -1 : 1);
    });
    rows.forEach(function (r) { body.appendChild(r); });
  });
});
"""


def _e(x) -> str:
    return html.escape(str(x))


def _bytes(n) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,} B"


def _table(head: list, rows: list, cls="sortable") -> str:
    """``head``: column titles (a title ending in ``#`` is numeric); ``rows``: (row class, cells)."""
    ths = "".join(f"<th class='n'>{_e(h[:-1])}</th>" if h.endswith("#") else f"<th>{_e(h)}</th>" for h in head)
    body = []
    for row_cls, cells in rows:
        tds = "".join(f"<td class='n'>{c}</td>" if h.endswith("#") else f"<td>{c}</td>" for h, c in zip(head, cells))
        body.append(f"<tr class='{row_cls}'>{tds}</tr>")
    return f"<table class='{cls}'><thead><tr>{ths}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _verdict_html(v: Verdict, report) -> str:
    cards = []
    for name, ratio in v.speedups().items():
        base = v.baselines[name]
        cls = "win" if ratio > 1.0005 else "loss" if ratio < 0.9995 else ""
        cards.append(
            f"<div class='card {cls}'><div class='sub'>against <b>{_e(baseline_label(name, report))}</b></div>"
            f"<div class='big'>{ratio:.2f}&times;</div><div class='sub'>{base:,} &rarr; {v.fused_cycles:,} cycles<br>"
            f"{v.seconds(base) * 1e3:,.3f} ms &rarr; {v.seconds(v.fused_cycles) * 1e3:,.3f} ms</div></div>")
    how = ("simulated: the NPU simulator ran every kernel of both graphs and counted the cycles"
           if v.source == "simulated" else
           "predicted by the cost model (the planner's prices, whole graph); run with <code>--simulate</code> to "
           "measure it on the NPU simulator")
    a, r = len(report.applied), len(report.rejected)
    return (f"<div class='verdict' id='verdict'>{''.join(cards)}"
            f"<div class='card'><div class='sub'>fusions</div><div class='big'>{a} / {a + r}</div>"
            f"<div class='sub'>{a} applied, {r} not fused</div></div></div>"
            f"<p class='meta'>Whole model on {_e(v.device)}, {how}.</p>")


def _memory_html(report) -> str:
    top = max(report.peak_memory_unfused, report.peak_memory_fused, report.memory_budget or 0, 1)
    rows = [("unfused", report.peak_memory_unfused, ""), ("fused", report.peak_memory_fused, "f")]
    if report.memory_budget is not None:
        rows.append(("budget", report.memory_budget, ""))
    cells = [("", [_e(k), _bytes(v), f"<span class='bar {c}' style='width:{300 * v / top:.0f}px'></span>"])
             for k, v, c in rows]
    warn = "".join(f"<p class='warn'>{_e(w)}</p>" for w in report.warnings)
    return "<h2 id='memory'>Memory</h2>" + _table(["peak activation memory", "bytes#", ""], cells, "") + warn


def _same(d) -> tuple:
    """What a row of the decision table shows besides the anchor: decisions that agree share one row."""
    return (d.applied, d.reason_code, d.reason, d.cycles_unfused, d.cycles_fused, d.hbm_bytes_saved,
            d.working_set_bytes, d.workspace_bytes, d.bound_fused)


def _decision_rows(ds) -> list:
    groups: dict = {}
    for d in ds:
        groups.setdefault(_same(d), []).append(d)
    rows = []
    for same in groups.values():
        d = same[0]
        anchors = " ".join(f"<code>{_e(x.anchor)}</code>" for x in same)
        if len(same) > 1:
            anchors = f"<details><summary>&times;{len(same)} identical</summary>{anchors}</details>"
        f = d.shown()
        rows.append(("applied" if d.applied else "rejected", [
            "fused" if d.applied else "not fused", anchors, _e(d.reason_code), _e(d.reason), f"{d.cycles_unfused:,}",
            f["cycles_fused"], f["speedup"], f["hbm_bytes_saved"], f"{d.working_set_bytes:,}",
            f"{d.workspace_bytes:,}", _e(d.bound_fused)]))
    return rows


_DECISION_HEAD = ["", "anchor (candidates with equal figures share a row)", "reason code", "reason", "unfused cycles#", "fused cycles#", "speed-up#",
                  "HBM saved (B)#", "working set (B)#", "of it workspace (B)#", "fused bound"]


def _fusions_html(report) -> str:
    out = ["<h2 id='fusions'>What was fused, what was not, and why</h2>"]
    if not report.decisions:
        out.append("<p>No fusible block was found in this graph.</p>")
        return "".join(out)
    rows = [("", [_e(code), str(n), _e(meaning)]) for code, n, meaning in reason_counts(report)]
    out.append(_table(["reason code", "candidates#", "meaning"], rows))
    out.append("<p class='meta'>The cycles in the tables below are the cost model's predictions, the figures the "
               "planner decided on, also where the page's verdict is simulated.</p>")
    for fam in sorted({d.pattern for d in report.decisions}):
        ds = sorted((d for d in report.decisions if d.pattern == fam), key=lambda d: not d.applied)
        applied = sum(d.applied for d in ds)
        out.append(f"<h3><span class='swatch' style='background:{family_colour(fam)}'></span>{_e(fam)}: "
                   f"{applied} fused, {len(ds) - applied} not fused</h3>")
        out.append(_table(_DECISION_HEAD, _decision_rows(ds)))
    return "".join(out)


def _choices_html(report) -> str:
    rows = implementation_rows(report)
    if not rows:
        return ""
    body = [("", [_e(name), f"<code>{_e(anchor)}</code>", _e(dev), _e(chosen), f"{cycles:,}", _e(others)])
            for name, anchor, dev, chosen, cycles, others in rows]
    return ("<h2 id='choices'>Implementation choices per device</h2><p class='meta'>Each fused region's "
            "implementations priced on every device profile; the chosen one is the cheapest this kernel can run "
            "(the others marked priced only have no kernel here: they show what the choice is worth)."
            "</p>" + _table(["region", "anchor", "device", "chosen", "cycles#", "other implementations (cycles)"],
                            body))


def _layer_speedup(r) -> str:
    """A layer row's speed-up, or what its figures mean where a ratio would not: all of its ops fused into a block
    placed in another row, or only a block placed here from other rows."""
    if r.fused and r.unfused:
        return f"{r.unfused / r.fused:.2f}x"
    return "fused elsewhere" if r.unfused else "fused here" if r.fused else ""


def _layers_html(rows: list, source: str) -> str:
    if not rows:
        return ""
    top = max(max(r.unfused, r.fused) for r in rows) or 1
    cells = []
    for r in rows:
        name = _e(r.name) if r.count == 1 else f"{_e(r.name)} <b>&times;{r.count}</b> identical"
        bars = (f"<span class='bar' style='width:{160 * r.unfused / top:.0f}px'></span><br>"
                f"<span class='bar f' style='width:{160 * r.fused / top:.0f}px'></span>")
        kids = "".join(f"<tr><td>{_e(k)}</td><td class='n'>{u:,}</td><td class='n'>{f:,}</td></tr>"
                       for k, u, f in r.children if u or f)
        detail = (f"<details><summary>{len(r.children)} parts</summary><table><tr><th>part</th><th class='n'>"
                  f"unfused</th><th class='n'>fused</th></tr>{kids}</table></details>") if len(r.children) > 1 else ""
        cells.append(("", [name + detail, _e(r.cls), f"{r.unfused:,}", f"{r.fused:,}",
                           _layer_speedup(r), f"{r.count * r.fused:,}", bars]))
    total_u = sum(r.unfused * r.count for r in rows)
    total_f = sum(r.fused * r.count for r in rows)
    return (f"<h2 id='layers'>Time per layer</h2><p class='meta'>{source} cycles per layer of the module hierarchy "
            f"(blue unfused, green fused); rows of identical consecutive layers are folded, with the cycles of one "
            f"layer and the total of all. A row holds its module's own ops; a fused block whose ops span several "
            f"modules sits in their closest common module, so one row may lose ops (fused elsewhere) that another "
            f"gains. Whole graph: {total_u:,} &rarr; {total_f:,} cycles.</p>"
            + _table(["layer", "module", "unfused cycles (one)#", "fused cycles (one)#", "speed-up#",
                      "fused cycles (all)#", ""], cells))


def _own_ids(svg: str, prefix: str) -> str:
    """``svg`` with every ``id`` and every reference to one (``#id`` in ``href``, ``url(#id)``) prefixed: two pictures
    on one page (Graphviz numbers both ``graph0``, ``node1``, ...) then share no id."""
    ids = set(re.findall(r'\bid="([^"]+)"', svg))
    if not ids:
        return svg
    def own(name):
        return prefix + name if name in ids else name
    svg = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{prefix}{m.group(1)}"', svg)
    svg = re.sub(r'(href=")#([^"]+)"', lambda m: f'{m.group(1)}#{own(m.group(2))}"', svg)
    return re.sub(r"url\(#([^)]+)\)", lambda m: f"url(#{own(m.group(1))})", svg)


def report_html(report, before: fx.GraphModule, after: fx.GraphModule, *, title: str = "", simulations=None,
                extra_baselines: dict | None = None, graphs: dict | None = None, simulation=None) -> str:
    """The HTML page (see the module docstring). ``simulations``: ``{"fused": SimulationResult, "eager op by
    op": SimulationResult, ...}``; ``simulation``: the fused graph's simulation alone (kept for callers of the
    first version; its figures annotate the fused graph). ``graphs``: caption -> inline SVG (any other text is
    shown escaped, never as markup)."""
    sims = dict(simulations or {})
    if simulation is not None:
        sims.setdefault("fused", simulation)
    device = report.device
    before_costs = node_costs(before, device, report, sims.get(BASELINE))
    after_costs = node_costs(after, device, report, sims.get("fused"), before=before_costs)
    v = verdict(device, before_costs, after_costs, sims if BASELINE in sims else None, extra_baselines)
    source = "Simulated" if v.source == "simulated" else "Predicted"
    parts = [f"<h1>{_e(title or 'autofuse report')}</h1>",
             f"<p class='meta'>{_e(device)} at {_e(report.optimization_level)}; captured by "
             f"{_e(report.capture_route or '?')}; graph {report.nodes_before:,} &rarr; {report.nodes_after:,} nodes"
             + (f"; memory budget {_bytes(report.memory_budget)}" if report.memory_budget is not None else "")
             + "</p>"
             + (f"<p class='meta'><b>Planned for training mode</b> ({_e(TRAINING_NOTE)}).</p>"
                if getattr(report, "training", False) else "")
             + (f"<p class='meta'>Re-planned because {_e(report.replanned_because)}.</p>"
                if getattr(report, "replanned_because", "") else ""),
             _verdict_html(v, report), _memory_html(report), _fusions_html(report),
             _choices_html(report)]
    roof = roofline_svg(device, _main_dtype(before), before_costs, after_costs)
    if roof:
        parts.append(f"<h2 id='roofline'>Roofline</h2><p class='meta'>{source} cycles; FLOPs counted from the "
                     f"shapes; unfused kernels hollow, fused kernels filled.</p><div>{roof}</div>")
    parts.append(_layers_html(layer_rows(before, after, before_costs, after_costs), source))
    if getattr(report, "guards", None):
        parts.append(f"<p class='meta'>Re-planned if these change: {_e('; '.join(report.guards))}.</p>")
    for i, (caption, svg) in enumerate((graphs or {}).items()):
        # an inline SVG picture goes in as markup, its ids made its own; anything else (a DOT text) as escaped text
        body_ = _own_ids(svg, f"p{i}-") if str(svg).lstrip().startswith("<svg") else f"<pre>{_e(svg)}</pre>"
        parts.append(f"<h2>{_e(caption)}</h2><div class='graph'>{body_}</div>")
    if report.timings:
        parts.append("<h2>Compile time</h2>" + _table(
            ["stage", "seconds#"], [("", [_e(k.removesuffix('_s')), f"{t:.3f}"]) for k, t in report.timings.items()],
            ""))
    body = "\n".join(p for p in parts if p)
    return (f"<!doctype html>\n<html lang='en'><head><meta charset='utf-8'><title>{_e(title or 'autofuse report')}"
            f"</title><style>{_CSS}</style></head><body>\n{body}\n<script>{_JS}</script></body></html>\n")
