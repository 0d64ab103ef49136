"""The cost model's front door: ``estimate`` and ``roofline`` for every simulator kernel.

Each kernel module registers a *model*: a pure function of (input specs, device, parameters) that returns an
:class:`Estimate`. Input specs are ``(shape, dtype)`` pairs; tensor-valued parameters (``mask=``, ``bias=``)
may be given as a spec, ``None``, or anything with ``.shape`` and ``.dtype`` (only those two are read).
Results are cached by their arguments (``functools.lru_cache``): the compiler prices the same shapes many
times.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields

from cost_model.devices import ITEMSIZE, Device, get_device
from cost_model.lowering import geometry as _geometry_cache

UNITS = ("mte1", "mte2", "mte3", "fixpipe", "cube", "vector", "scalar")

MODELS: dict = {}
ROOFLINES: dict = {}
CACHES: list = []          # functools caches of the models (tiling searches), cleared by clear_caches()


@dataclass(frozen=True)
class Estimate:
    """What a kernel launch is predicted to cost (the simulator's ``Stats``, predicted).

    ``cycles`` includes the launch overhead and the HBM cap, as the simulator's do. ``bytes`` is per data
    path summed over cores; ``busy`` is per unit on the busiest core; ``bound`` is the busiest unit;
    ``tiling`` is the tiling the prediction assumes (hand it to the kernel as ``tiling=``); ``roofline``
    is the physical lower bound in cycles (no launch overhead); ``flops`` counts multiply-adds as 2;
    ``workspace_bytes`` is the GM the kernel allocates besides its outputs.
    """

    kernel: str
    device: str
    cycles: int
    hbm_bytes: int
    bytes: dict
    busy: dict
    bound: str
    tiling: dict | None
    roofline: float = 0.0
    flops: float = 0.0
    notes: tuple = field(default=())
    workspace_bytes: int = 0       # GM the kernel allocates besides its outputs (the simulator's Stats field)
    phases: tuple = ()             # (name, end in cycles) of each phase between SyncAlls, for kernels that have them

    @property
    def seconds(self) -> float:
        return self.cycles / get_device(self.device).clock_hz

    @property
    def util(self) -> dict:
        return {u: b / self.cycles for u, b in self.busy.items()}


_FIELDS = tuple(f.name for f in fields(Estimate))


def _new_estimate(*values) -> Estimate:
    """``Estimate(*values)`` (every field, in order). The frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__``, which shows at the rate estimates are made (two a call: the model's and the copy
    ``estimate`` returns); the instance's ``__dict__`` filled at once holds the same fields, and the instance
    stays frozen."""
    e = object.__new__(Estimate)
    e.__dict__.update(zip(_FIELDS, values))
    return e


def register(name: str, roofline_fn=None):
    """Register ``fn(dev, specs, **params) -> Estimate`` as the model of kernel ``name``."""
    def deco(fn):
        MODELS[name] = fn
        if roofline_fn is not None:
            ROOFLINES[name] = roofline_fn
        return fn
    return deco


def spec(x) -> tuple | None:
    """``(shape tuple, dtype str)`` of a spec pair, an array-like, or ``None``."""
    if x is None:
        return None
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        dt = str(x.dtype).replace("torch.", "")
        return tuple(map(int, x.shape)), dt
    shape, dtype = x
    dtype = str(dtype).replace("torch.", "")
    if dtype not in ITEMSIZE:
        raise TypeError(f"unsupported dtype {dtype!r}: the cost model knows {', '.join(ITEMSIZE)}")
    return tuple(map(int, shape)), dtype


def _freeze(v):
    if isinstance(v, dict):
        return ("__dict__", tuple(sorted((k, _freeze(x)) for k, x in v.items())))
    if hasattr(v, "shape") and hasattr(v, "dtype") and not isinstance(v, (int, float, bool)):
        return ("__spec__", spec(v))
    if isinstance(v, (list, tuple)):
        if len(v) == 2 and isinstance(v[1], str) and isinstance(v[0], (list, tuple)):
            return ("__spec__", spec(v))
        return tuple(_freeze(x) for x in v)
    return v


def _thaw(v):
    if isinstance(v, tuple) and len(v) == 2 and v[0] == "__dict__":
        return {k: _thaw(x) for k, x in v[1]}
    if isinstance(v, tuple) and len(v) == 2 and v[0] == "__spec__":
        return v[1]
    if isinstance(v, tuple):
        return tuple(_thaw(x) for x in v)
    return v


@functools.lru_cache(maxsize=65536)
def _estimate(kernel: str, specs: tuple, device: str, params: tuple) -> Estimate:
    dev = get_device(device)
    return MODELS[kernel](dev, specs, **{k: _thaw(v) for k, v in params})


CACHES.append(_estimate)
CACHES.append(_geometry_cache)      # the Vector programs' row geometry (cost_model.lowering, shared data)


def cached(fn):
    """``functools.lru_cache`` registered with :func:`clear_caches`."""
    c = functools.lru_cache(maxsize=4096)(fn)
    CACHES.append(c)
    return c


def clear_caches() -> None:
    """Forget every cached estimate and tiling search (for timing the model cold)."""
    for c in CACHES:
        c.cache_clear()


def estimate(kernel: str, inputs, device="ascend910", **params) -> Estimate:
    """Predicted cost of ``npu.run(kernel, *inputs, device=device, **params)`` without running it.

    ``inputs``: a list of ``(shape, dtype)`` (or arrays/tensors, of which only shape and dtype are read;
    ``None`` for an absent optional input). Unknown kernels fall back to :func:`cost_model.generic.generic_op`
    only when called through that function; here they are an error naming the known kernels.
    """
    if kernel not in MODELS:
        raise ValueError(f"cost model has no kernel {kernel!r}: known are {', '.join(sorted(MODELS))}")
    dev = get_device(device)
    specs = tuple(spec(x) for x in inputs)
    frozen = tuple(sorted((k, _freeze(v)) for k, v in params.items()))
    e = _estimate(kernel, specs, dev.name, frozen)
    # a copy, so that a caller mutating the dicts does not poison the cache
    # (every field in order: what ``dataclasses.replace`` does with these three, without its field walk)
    return _new_estimate(e.kernel, e.device, e.cycles, e.hbm_bytes, dict(e.bytes), dict(e.busy), e.bound,
                         None if e.tiling is None else dict(e.tiling), e.roofline, e.flops, e.notes,
                         e.workspace_bytes, e.phases)


def roofline(kernel: str, inputs, device="ascend910", **params) -> float:
    """Physical lower bound in cycles: max(FLOPs / peak of the unit, minimum HBM bytes / HBM bandwidth).

    The minimum HBM bytes are the inputs read once and the outputs written once; the peak is the Cube's for
    Cube kernels and the Vector unit's (all vector cores) for vector kernels. No launch overhead.
    """
    if kernel not in ROOFLINES:
        raise ValueError(f"cost model has no roofline for {kernel!r}: known are {', '.join(sorted(ROOFLINES))}")
    dev = get_device(device)
    specs = tuple(spec(x) for x in inputs)
    return float(ROOFLINES[kernel](dev, specs, **params))


def kernel_cycles(dev: Device, core: float, hbm: float, bytes_: dict) -> float:
    """Kernel time before the launch overhead, as the simulator's ``Launch.finish`` takes it: the slowest
    core, never less than the HBM bytes over the HBM bandwidth nor the GM traffic (every ``bytes`` path to
    or from GM: it all passes through L2) over the L2 bandwidth."""
    l2 = 0                          # (the sum() of these, in order, without a generator: every candidate is priced)
    for k, v in bytes_.items():
        if "GM" in k:
            l2 += v
    return max(core, hbm / dev.hbm_bytes_per_cycle, l2 / dev.l2_bytes_per_cycle)


def make(kernel: str, dev: Device, cycles: float, hbm: float, bytes_: dict, busy: dict, tiling, roof: float,
         flops: float = 0.0, notes=(), workspace: float = 0, phases=()) -> Estimate:
    """Assemble an :class:`Estimate`: the HBM and L2 caps (:func:`kernel_cycles`) and the launch overhead
    added as the simulator adds them."""
    body = kernel_cycles(dev, cycles, hbm, bytes_)
    total = int(-(-body // 1)) + dev.launch_cycles
    units = UNITS + ("link",) if "link" in busy else UNITS      # kernels that communicate report their link
    get = busy.get
    busy = {u: int(round(get(u, 0.0))) for u in units}
    bound = max(units, key=busy.__getitem__)
    return _new_estimate(kernel, dev.name, total, int(round(hbm)), {k: int(round(v)) for k, v in bytes_.items() if v},
                         busy, bound, tiling, float(roof), float(flops), tuple(notes), int(workspace), tuple(phases))


__all__ = ["Estimate", "MODELS", "UNITS", "cached", "clear_caches", "estimate", "kernel_cycles", "make", "register", "roofline", "spec"]

