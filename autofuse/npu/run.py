"""``npu.run``: convert inputs, launch a kernel on a fresh simulated chip, collect outputs and stats.

``npu.run(..., timing_only=True)`` runs the same tile program on the same timelines without computing a
value (see :class:`autofuse.npu.machine.Launch`, ``values=False``): its :class:`Stats` and trace are those of
the full launch, its outputs are :class:`~autofuse.npu.machine.Absent` (shapes only). Inputs are not
converted or copied, except the kernel's *steering* inputs (``@kernel(name, steer=(...))``), whose values
decide the program itself (which GM regions are read, group sizes, token routing); kernels whose timing
depends on values they compute themselves (``steer=ALL``) run a full launch.
"""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

import numpy as np

from autofuse.npu.dtypes import FLOATS, name_of
from autofuse.npu.machine import Absent, GMTensor, Launch, Stats, host_blas
from autofuse.npu.trace import Trace
from cost_model.devices import devices as _device_names
from cost_model.devices import get_device

KERNELS: dict = {}
#: kernel name -> the names of its parameters whose values steer its program, or ALL
STEER: dict = {}
ALL = "all"


def kernel(name: str, steer=()):
    """Register ``fn(launch, *inputs: GMTensor, **params) -> tuple[GMTensor, ...]`` as kernel ``name``.

    ``steer``: the parameters (inputs or keyword tensors, by name) whose *values* the program reads to decide
    what it issues, e.g. a gather's indices (which rows are loaded) or a grouped GEMM's group list; a
    timing-only launch gets their values and nothing else's. ``steer=ALL``: the timing depends on values the
    kernel computes (e.g. ties re-selected on the Scalar unit), so a timing-only launch runs in full.
    """
    def register(fn):
        KERNELS[name] = fn
        STEER[name] = steer if steer == ALL else tuple(steer)
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
    timing_only: bool = False         # outputs are Absent (shapes only)

    def torch_outputs(self):
        """The outputs as torch tensors of the kernel's element types (bf16 included)."""
        if self.timing_only:
            raise ValueError("a timing-only launch has no output values; run it with timing_only=False")
        import torch
        return tuple(torch.from_numpy(np.ascontiguousarray(o)).to(getattr(torch, dt))
                     for o, dt in zip(self.outputs, self.dtypes))


def _to_numpy(x, what: str):
    if x is None:
        return None, None
    if isinstance(x, Absent):
        raise ValueError(f"{what} has no values (a timing-only launch's output); run the launch that made it "
                         f"with timing_only=False")
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


def _absent(t: GMTensor) -> Absent:
    """A timing-only output: its shape and element type."""
    return Absent(t.shape, np.float16 if t.dtype == "float16" else t.data.dtype, t.dtype)


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


def _placeholder(launch, x, what: str, name: str):
    """A timing-only launch's input without its values (torch, meta or numpy tensor, or an Absent output)."""
    if x is None:
        return None
    if isinstance(x, Absent):
        return launch.placeholder(x.shape, x.element or name_of(x), name)
    if hasattr(x, "detach") or isinstance(x, np.ndarray):
        return launch.placeholder(tuple(x.shape), name_of(x), name)
    raise TypeError(f"{what} is a {type(x).__name__}; give a torch tensor or a numpy array")


def input_names(fn, n: int) -> list:
    """The parameter name each of ``n`` positional inputs of kernel function ``fn`` binds to (``*inputs``
    binds them all)."""
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "launch"]
    out = []
    for i in range(n):
        p = params[min(i, len(params) - 1)] if params else None
        out.append(p.name if p is not None and (i < len(params) or p.kind == p.VAR_POSITIONAL) else f"in{i}")
    return out


def run(kernel_name: str, *inputs, device="ascend910", timing_only=False, **params) -> Result:
    """Run ``kernel_name`` on ``inputs`` (numpy arrays or torch tensors; ``None`` for an absent optional).

    ``timing_only=True``: the same statistics and trace without computing values (module docstring); inputs
    other than the kernel's steering ones may then be meta tensors or earlier timing-only outputs."""
    if kernel_name not in KERNELS:
        raise ValueError(f"unknown kernel {kernel_name!r}: available are {', '.join(sorted(KERNELS))}")
    fn = KERNELS[kernel_name]
    dev = get_device(device)
    accepted = inspect.signature(fn).parameters
    names = [p for p in accepted if p != "launch"]
    for k in params:
        if k not in accepted:
            raise TypeError(f"kernel {kernel_name!r} takes no parameter {k!r}; it takes {', '.join(names)}")
    steer = STEER.get(kernel_name, ())
    values = not timing_only or steer == ALL
    launch = Launch(dev, kernel_name, values=values)
    gm_inputs = []
    bound = input_names(fn, len(inputs))
    for i, x in enumerate(inputs):
        what, name = f"input {i} of {kernel_name}", names[i] if i < len(names) else f"in{i}"
        if not values and bound[i] not in steer:
            gm_inputs.append(_placeholder(launch, x, what, name))
            continue
        arr, dt = _to_numpy(x, what)
        gm_inputs.append(None if arr is None else launch.tensor(arr, dt, name))
    # keyword tensors (e.g. mask=...) become GM tensors too
    for k, v in list(params.items()):
        if isinstance(v, Absent) or (hasattr(v, "shape") and not np.isscalar(v)):
            if not values and k not in steer:
                params[k] = _placeholder(launch, v, f"{k} of {kernel_name}", k)
                continue
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
    trace = Trace(kernel_name, dev, launch.events, launch.groups, cycles=stats.cycles, overheads=launch.overheads)
    if not values:
        return Result(outputs=tuple(_absent(o) for o in outs), stats=stats, trace=trace,
                      dtypes=tuple(o.dtype for o in outs), timing_only=True)
    return Result(outputs=tuple(_from_storage(o) for o in outs), stats=stats, trace=trace,
                  dtypes=tuple(o.dtype for o in outs), timing_only=timing_only)


# Register the kernels.
from autofuse.npu.kernels import generic as _generic  # noqa: E402,F401
from autofuse.npu.kernels import matmul as _matmul  # noqa: E402,F401
from autofuse.npu.kernels import conv as _conv  # noqa: E402,F401
from autofuse.npu.kernels import softmax as _softmax  # noqa: E402,F401
from autofuse.npu.kernels import vector as _vector  # noqa: E402,F401
from autofuse.npu.kernels import norm as _norm  # noqa: E402,F401
from autofuse.npu.kernels import flash_attention as _flash_attention  # noqa: E402,F401
from autofuse.npu.kernels import score_bound as _score_bound  # noqa: E402,F401
from autofuse.npu.kernels import dropout as _dropout  # noqa: E402,F401
from autofuse.npu.kernels import movement as _movement  # noqa: E402,F401
from autofuse.npu.kernels import moe_gating as _moe_gating  # noqa: E402,F401
from autofuse.npu.kernels import moe_routing as _moe_routing  # noqa: E402,F401
from autofuse.npu.kernels import moe_grad as _moe_grad  # noqa: E402,F401
from autofuse.npu.kernels import grouped_matmul as _grouped_matmul  # noqa: E402,F401
from autofuse.npu.kernels import grouped_matmul_grad as _grouped_matmul_grad  # noqa: E402,F401
from autofuse.npu.kernels import collectives as _collectives  # noqa: E402,F401
from autofuse.npu.kernels import mc2 as _mc2  # noqa: E402,F401
from autofuse.npu.kernels import vector_program as _vector_program  # noqa: E402,F401
from autofuse.npu.kernels import matmul_epilogue as _matmul_epilogue  # noqa: E402,F401
from autofuse.npu.kernels import moe_ep as _moe_ep  # noqa: E402,F401
from autofuse.npu.kernels import flash_attention_grad as _flash_attention_grad  # noqa: E402,F401
