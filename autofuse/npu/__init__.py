"""A numpy-backed simulator of a Cube/Vector NPU (Ascend-style).

    from autofuse import npu
    npu.devices()                                    # ['ascend310p', 'ascend910', 'ascend910b']
    r = npu.run("matmul", a, b, device="ascend910")  # numpy arrays or torch tensors
    r.outputs, r.stats.cycles, r.stats.util, r.trace.save("matmul.json")

Kernels are SPMD programs (``autofuse/npu/kernels``) that move tiles through the core's buffers and
occupy its units; :mod:`autofuse.npu.machine` counts what they do.
"""
from autofuse.npu.machine import Absent, CapacityError, Launch, SimulatorError, Stats
from autofuse.npu.run import KERNELS, Result, devices, run

__all__ = ["Absent", "CapacityError", "KERNELS", "Launch", "Result", "SimulatorError", "Stats", "devices", "run"]
