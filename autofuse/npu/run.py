"""``npu.run``: convert inputs, launch a kernel on a fresh simulated chip, collect outputs and stats."""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

import numpy as np

from autofuse.npu.dtypes import FLOATS, name_of
from autofuse.npu.machine import GMTensor, Launch, Stats, host_blas
from autofuse.npu.trace import Trace
from cost_model.devices import devices as _device_names
from cost_model.devices import get_device

KERNELS: dict = {}


def kernel(name: str):
    """Register ``fn(launch, *inputs: GMTensor, **params) -> tuple[GMTensor, ...]`` as kernel ``name``."""
    def register(fn):
        KERNELS[name] = fn
        return fn
    return register


def devices() -> list[str]:
    """Names of the simulated devices."""
    return _device_names()


@dataclass
class Result:
    """What one kernel launch produced: ``outputs`` (numpy), ``stats`` (:class:`Stats`), ``trace``."""

    outputs: tuple
    stats: Stats
    trace: Trace
    dtypes: tuple = ()

    def torch_outputs(self):
        """The outputs as torch tensors of the kernel's element types (bf16 included)."""
        import torch
        return tuple(torch.from_numpy(np.ascontiguousarray(o)).to(getattr(torch, dt))
                     for o, dt in zip(self.outputs, self.dtypes))


def _to_numpy(x, what: str):
    if x is None:
        return None, None
    if hasattr(x, "detach"):          # a torch tensor
        if x.device.type == "meta":
            raise ValueError(f"{what} is a meta tensor: the simulator needs data (use cost_model for shapes only)")
        dt = name_of(x)
        t = x.detach().cpu()
        if dt == "bfloat16":
            t = t.float()
        return t.numpy(), dt
    arr = np.asarray(x)
    return arr, name_of(arr)


def _from_storage(t: GMTensor) -> np.ndarray:
    if t.dtype == "float16":
        torch = sys.modules.get("torch")
        data = t.data
        if torch is not None and data.dtype == np.float32 and data.size >= 1 << 16 and not np.isnan(data).any():
            # torch's float32 -> float16 cast is vectorised (numpy's is ~40x slower here); both round to
            # nearest even, bit for bit (they differ only in the quiet bit of signalling NaNs, hence the check)
            return torch.from_numpy(np.ascontiguousarray(data)).to(torch.float16).numpy()
        return data.astype(np.float16)
    if t.dtype in FLOATS:
        return t.data.astype(np.float32, copy=False)
    return t.data


def run(kernel_name: str, *inputs, device="ascend910", **params) -> Result:
    """Run ``kernel_name`` on ``inputs`` (numpy arrays or torch tensors; ``None`` for an absent optional)."""
    if kernel_name not in KERNELS:
        raise ValueError(f"unknown kernel {kernel_name!r}: available are {', '.join(sorted(KERNELS))}")
    fn = KERNELS[kernel_name]
    dev = get_device(device)
    accepted = inspect.signature(fn).parameters
    names = [p for p in accepted if p != "launch"]
    for k in params:
        if k not in accepted:
            raise TypeError(f"kernel {kernel_name!r} takes no parameter {k!r}; it takes {', '.join(names)}")
    launch = Launch(dev, kernel_name)
    gm_inputs = []
    for i, x in enumerate(inputs):
        arr, dt = _to_numpy(x, f"input {i} of {kernel_name}")
        gm_inputs.append(None if arr is None else launch.tensor(arr, dt, names[i] if i < len(names) else f"in{i}"))
    # keyword tensors (e.g. mask=...) become GM tensors too
    for k, v in list(params.items()):
        if hasattr(v, "shape") and not np.isscalar(v):
            arr, dt = _to_numpy(v, f"{k} of {kernel_name}")
            params[k] = launch.tensor(arr, dt, k)
    with host_blas():                  # OpenBLAS on one thread, GEMMs split over the simulator's threads
        try:
            outs = fn(launch, *gm_inputs, **params)
            launch.sync()              # values a kernel computes behind its timeline (Launch.defer)
        except BaseException:
            try:
                launch.close()
            except BaseException:      # the first failure is the one to report
                pass
            raise
    stats = launch.finish()
    returned = {id(o) for o in outs}
    stats.workspace_bytes = sum(b for t, b in launch.allocated if id(t) not in returned)
    trace = Trace(kernel_name, dev, launch.events, launch.groups)
    return Result(outputs=tuple(_from_storage(o) for o in outs), stats=stats, trace=trace,
                  dtypes=tuple(o.dtype for o in outs))


# Register the kernels.
from autofuse.npu.kernels import generic as _generic  # noqa: E402,F401
from autofuse.npu.kernels import matmul as _matmul  # noqa: E402,F401
from autofuse.npu.kernels import softmax as _softmax  # noqa: E402,F401
from autofuse.npu.kernels import vector as _vector  # noqa: E402,F401
from autofuse.npu.kernels import norm as _norm  # noqa: E402,F401
from autofuse.npu.kernels import flash_attention as _flash_attention  # noqa: E402,F401
from autofuse.npu.kernels import movement as _movement  # noqa: E402,F401
from autofuse.npu.kernels import moe_gating as _moe_gating  # noqa: E402,F401
from autofuse.npu.kernels import moe_routing as _moe_routing  # noqa: E402,F401
from autofuse.npu.kernels import grouped_matmul as _grouped_matmul  # noqa: E402,F401
from autofuse.npu.kernels import collectives as _collectives  # noqa: E402,F401
from autofuse.npu.kernels import mc2 as _mc2  # noqa: E402,F401
from autofuse.npu.kernels import moe_ep as _moe_ep  # noqa: E402,F401
