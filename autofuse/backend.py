"""``torch.compile(model, backend="autofuse")``: Dynamo hands us each captured graph; we fuse it.

Dynamo's graph is a torch-level ``fx.GraphModule`` with example inputs; the engine captures it again
to aten (``torch.export``), plans on those inputs and returns the fused module's forward. Settings other
than the defaults: ``torch.compile(model, backend=autofuse.backend(target_device="ascend910b"))``.
"""
from __future__ import annotations

import torch


def backend(target_device="ascend910", optimization_level="O3", memory_budget=None, verify=True):
    """A Dynamo backend with the given engine settings; see :func:`autofuse.AutoFusionEngine.fuse`."""
    def compile_fn(gm: torch.fx.GraphModule, example_inputs):
        from autofuse.engine import AutoFusionEngine
        fused = AutoFusionEngine.fuse(gm, tuple(example_inputs), target_device=target_device,
                                      optimization_level=optimization_level, memory_budget=memory_budget,
                                      verify=verify)
        compile_fn.fused_modules.append(fused)

        def run(*args):
            out = fused(*args)
            return out
        return run

    compile_fn.fused_modules = []
    return compile_fn


def _register():
    try:
        from torch._dynamo import register_backend
        from torch._dynamo.backends.registry import _BACKENDS
    except ImportError:          # pragma: no cover - torch without Dynamo
        return
    if "autofuse" not in _BACKENDS:
        register_backend(name="autofuse")(backend())


_register()
