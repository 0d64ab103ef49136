"""autofuse: graph-level auto-fusion compiler for PyTorch on Cube/Vector NPUs.

    import autofuse
    fused = autofuse.AutoFusionEngine.fuse(model, (x,), target_device="ascend910", optimization_level="O3")
    fused(x); print(fused.report.summary()); fused.simulate(x)
    compiled = torch.compile(model, backend="autofuse"); compiled(x); autofuse.reports(compiled)

Submodules: ``capture``, ``canonicalize``, ``match``, ``plan``, ``rewrite``, ``engine`` (the pipeline),
``ops`` (fused ``torch.ops.autofuse.*``), ``npu`` (the simulator), ``simulate``, ``report``/``viz``, ``cli``.
"""
from autofuse.decision import FusionDecision, FusionReport
from autofuse.engine import AutoFusionEngine, FusedModule
from autofuse.simulate import SimulationResult, simulate
from autofuse import ops  # noqa: E402  (registers torch.ops.autofuse.*)
from autofuse.backend import backend, reports  # noqa: E402  (registers torch.compile(backend="autofuse"))

ops.refuse_batched_gradients()

__version__ = "0.1.0"
__all__ = ["AutoFusionEngine", "FusedModule", "FusionDecision", "FusionReport", "SimulationResult", "backend",
           "ops", "reports", "simulate"]
