"""What the planner decided, as values: :class:`FusionDecision` per candidate, :class:`FusionReport` per plan.

Reports, the CLI and the pictures read these objects, never log text. Reason codes are stable strings:

=========================  ==============================================================================
``fused``                  applied: cheaper fused (or forced by a switch), verified equal to the unfused subgraph
``disabled_by_opt_level``  the optimization level does not fuse this (O0 fuses nothing)
``below_level_margin``     O1 fuses only clear wins (predicted speed-up >= 1.5x)
``extra_outputs_at_O1``    O1 does not fuse blocks whose probabilities are used elsewhere
``not_profitable``         the cost model prices the fused kernel no cheaper than the unfused ops
``conflict``               overlaps a candidate that saves more; the global choice took that one
``memory_budget``          the fused kernel's working set (inputs, outputs, workspace) exceeds the budget
``disabled_by_switch``     the user switched the family or the region's name off (``fusion_switches``, ``--disable``)
``training_dropout``       a training-mode dropout the fused kernel cannot take (probabilities read outside, p = 1)
``returned_value_read``    with grad, it would read a value the model returns (a hidden state): cut there instead
``unsupported``            the kernel cannot run this instance (dtype, mask combination, no counterpart in
                           the captured graph, ...)
``verification_failed``    the fused kernel's result differed from the captured subgraph
``another_rank``           a pair that communicates, kept unfused because another rank of its process group keeps it
                           (its switch, budget, level, price or graph), as every rank must fuse such a pair alike
=========================  ==============================================================================
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

REASON_CODES = ("fused", "disabled_by_opt_level", "below_level_margin", "extra_outputs_at_O1", "not_profitable",
                "conflict", "memory_budget", "disabled_by_switch", "training_dropout", "returned_value_read",
                "unsupported", "verification_failed", "another_rank")


def hbm_change(saved: int) -> str:
    """What a fusion does to HBM traffic, in words: ``saves N B of HBM traffic``, or ``costs N B more HBM
    traffic`` where the fused kernel moves more (a fusion forced where it does not pay)."""
    return f"saves {saved:,} B of HBM traffic" if saved >= 0 else f"costs {-saved:,} B more HBM traffic"


def _is_dtype(v) -> bool:
    return type(v).__name__ == "dtype" and type(v).__module__ == "torch"


def jsonable(v):
    """``v`` in JSON's types, by rule: scalars as they are; a tuple, list or set as a list, and a dict with its keys
    as strings, each item converted; a torch dtype or device by its name (``float32``); a tensor by its dtype and
    shape (``float32[2, 4]``); a NumPy scalar as its value; anything else by ``str``."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list, set, frozenset)):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if _is_dtype(v) or (type(v).__name__ == "device" and type(v).__module__ == "torch"):
        return str(v).removeprefix("torch.")
    if hasattr(v, "dtype") and hasattr(v, "shape"):
        if type(v).__module__ == "numpy" and hasattr(v, "item"):       # a NumPy scalar
            return jsonable(v.item())
        return f"{jsonable(v.dtype)}{list(v.shape)}"
    return str(v)


@dataclass(frozen=True)
class FusionDecision:
    """One candidate's fate, with the numbers behind it (cycles on the target device, bytes of HBM)."""

    pattern: str
    nodes: tuple
    anchor: str
    applied: bool
    reason_code: str
    reason: str
    cycles_unfused: int
    cycles_fused: int
    hbm_bytes_unfused: int
    hbm_bytes_fused: int
    kernel: str = ""
    bound_fused: str = ""
    params: dict = field(default_factory=dict, hash=False, compare=False)
    tiling: dict = field(default_factory=dict, hash=False, compare=False)
    unfused_kernels: tuple = ()
    verify_error: float | None = None
    verify_tolerance: float | None = None
    verify_note: str = ""             # how it was verified when not at its own size (reduced shapes)
    working_set_bytes: int = 0        # the fused kernel's inputs, outputs and GM workspace (the budget's measure)
    workspace_bytes: int = 0          # of which the kernel's GM workspace

    @property
    def priced(self) -> bool:
        """Whether the fused kernel has a price (an ``unsupported`` candidate's cannot run here: -1)."""
        return self.cycles_fused >= 0

    @property
    def hbm_bytes_saved(self) -> int | None:
        return self.hbm_bytes_unfused - self.hbm_bytes_fused if self.priced else None

    @property
    def speedup(self) -> float | None:
        if not self.priced:
            return None
        return self.cycles_unfused / self.cycles_fused if self.cycles_fused else float("inf")

    def shown(self) -> dict:
        """The fused figures as reports print them: ``n/a`` where the fused kernel has no price."""
        if not self.priced:
            return {"cycles_fused": "n/a", "speedup": "n/a", "hbm_bytes_saved": "n/a"}
        return {"cycles_fused": f"{self.cycles_fused:,}", "speedup": f"{self.speedup:.2f}x",
                "hbm_bytes_saved": f"{self.hbm_bytes_saved:,}"}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["nodes"] = list(self.nodes)
        d["unfused_kernels"] = list(self.unfused_kernels)
        d["hbm_bytes_saved"] = self.hbm_bytes_saved
        d["speedup"] = None if self.speedup is None else round(self.speedup, 4)
        # the params of plain values, converted (:func:`jsonable`); the planner's own objects (a Vector program, a
        # tensor an output must look like) stay out
        d["params"] = {k: jsonable(v) for k, v in self.params.items()
                       if isinstance(v, (int, float, str, bool, type(None), list, tuple)) or _is_dtype(v)}
        alts = self.params.get("alternatives")
        if isinstance(alts, dict):       # each device's priced implementations, cheapest first
            d["params"]["alternatives"] = {dev: [{"implementation": name, "cycles": int(cycles), "runnable": bool(ok)}
                                                 for name, cycles, ok in rows] for dev, rows in alts.items()}
        return jsonable(d)


@dataclass
class FusionReport:
    """Every candidate of one plan: ``applied`` and ``rejected`` decisions, plus plan-wide figures."""

    device: str
    optimization_level: str
    memory_budget: int | None
    decisions: list = field(default_factory=list)
    peak_memory_unfused: int = 0
    peak_memory_fused: int = 0
    nodes_before: int = 0
    nodes_after: int = 0
    capture_route: str = ""
    warnings: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    training: bool = False             # planned for the model's training mode
    guards: list = field(default_factory=list)   # the values the plan relied on (re-planned if they change)
    replanned_because: str = ""        # the guard that fired, when this plan replaced an earlier one
    predicted_cycles: int = 0          # the whole graph fused, priced by the cost model
    baselines: dict = field(default_factory=dict)   # name -> predicted cycles ("eager op by op", "generic fusion
    #                                                 alone": automatic discovery without the pattern families, at
    #                                                 this plan's level and under its switches)
    fusion_switches: dict = field(default_factory=dict)   # the switches the plan was made under (name -> value)

    def speedups(self) -> dict:
        """Predicted whole-graph speed-up against each baseline."""
        return {k: v / max(self.predicted_cycles, 1) for k, v in self.baselines.items()}

    @property
    def applied(self) -> list:
        return [d for d in self.decisions if d.applied]

    @property
    def rejected(self) -> list:
        return [d for d in self.decisions if not d.applied]

    def of(self, *patterns: str) -> list:
        """The decisions on candidates of the named patterns (``report.of("attention")``), in plan order."""
        return [d for d in self.decisions if d.pattern in patterns]

    @property
    def cycles_saved(self) -> int:
        return sum(d.cycles_unfused - d.cycles_fused for d in self.applied)

    def summary(self) -> str:
        """A few lines of text: counts, then one line per candidate (rendered by :mod:`autofuse.report`)."""
        from autofuse.report import text_summary
        return text_summary(self)

    def __str__(self) -> str:       # print(report): the summary; repr() keeps every field
        return self.summary()

    def to_dict(self) -> dict:
        """The report in JSON's types (:func:`jsonable`): ``json.dumps`` takes it as it is."""
        return jsonable({
            "device": self.device, "optimization_level": self.optimization_level,
            "memory_budget": self.memory_budget, "capture_route": self.capture_route,
            "nodes_before": self.nodes_before, "nodes_after": self.nodes_after,
            "peak_memory_unfused": self.peak_memory_unfused, "peak_memory_fused": self.peak_memory_fused,
            "applied": [d.to_dict() for d in self.applied], "rejected": [d.to_dict() for d in self.rejected],
            "warnings": list(self.warnings), "timings": dict(self.timings), "training": self.training,
            "guards": list(self.guards), "replanned_because": self.replanned_because,
            "predicted_cycles": self.predicted_cycles, "baselines": dict(self.baselines),
            "fusion_switches": dict(self.fusion_switches),
        })

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), indent=kw.pop("indent", 2), **kw)

    def to_markdown(self, simulations: dict | None = None) -> str:
        """Markdown; ``simulations`` (name -> SimulationResult, ``"fused"`` among them) add the simulated verdict."""
        from autofuse.report import markdown
        return markdown(self, simulations)
