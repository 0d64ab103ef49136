"""Device profiles of Cube/Vector NPUs, from published figures.

Every figure carries its source in a comment. Tags follow ``shared/npu-facts.md``: **[D]** derived by
arithmetic from other published figures, **[T]** taken from a CANN test fixture / stub platform config
rather than a shipped spec, **[A]** an assumption of ours where nothing is published (kept few, named,
and never tuned to hit a target). Where sources disagree (⚠) the comment says which one we chose and why.

The simulator (``autofuse.npu``) and the cost model (``cost_model``) both read these objects and nothing
else about the hardware.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

# Bytes per element of the dtypes the hardware handles.
ITEMSIZE = MappingProxyType({"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1,
                             "int16": 2, "int32": 4, "int64": 8, "bool": 1})

KB = 1024
MB = 1024 * KB
GB = 1024 * MB


@dataclass(frozen=True)
class Device:
    """One NPU chip as the simulator and the cost model see it.

    ``arch`` is ``"coupled"`` (one AI core holds Cube and Vector units and shares their buffers) or
    ``"split"`` (AIC cores hold the Cube, AIV cores hold the Vector; they exchange data through L2/GM).
    Rates are per core per cycle at ``clock_hz``.
    """

    name: str
    arch: str
    cube_cores: int                  # cores with a Cube unit (coupled AI cores, or AIC)
    vector_cores: int                # cores with a Vector unit that a vector-only kernel may use
    clock_hz: float
    cube_macs: MappingProxyType      # dtype -> multiply-accumulates per cycle per core
    cube_k0: MappingProxyType        # dtype -> K extent of one Cube fractal (M0 = N0 = 16)
    vector_bytes_per_cycle: int      # one Vector "repeat": 256 B of lanes
    buffers: MappingProxyType        # buffer -> capacity in bytes, per core (UB: per vector core)
    align: MappingProxyType          # buffer -> start-address alignment in bytes
    rates: MappingProxyType          # data path "SRC->DST" -> bytes per cycle per core
    l2_bytes: int
    l2_bytes_per_cycle: float        # whole-chip L2 read/write bandwidth
    hbm_bytes: int
    hbm_bytes_per_cycle: float       # whole-chip HBM/DRAM bandwidth
    launch_cycles: int               # fixed cost of one kernel launch
    scalar_issue_cycles: int         # Scalar-unit cycles to issue one instruction to a queue
    notes: tuple = field(default=())

    @property
    def cores(self) -> int:
        return self.cube_cores

    def cube_peak_flops(self, dtype: str = "float16") -> float:
        return 2.0 * self.cube_macs[dtype] * self.cube_cores * self.clock_hz

    def vector_lanes(self, dtype: str) -> int:
        return self.vector_bytes_per_cycle // ITEMSIZE[dtype]

    def seconds(self, cycles: float) -> float:
        return cycles / self.clock_hz


# --- figures shared by every AI core -------------------------------------------------------------
# Cube: 16x16x16 fp16 MACs per cycle (Hot Chips 31 / hiascend "基本架构" / CANN ini [DtypeMKN]);
# int8 16x32x16. fp32 16x8x16 and bf16 16x16x16 follow the [DtypeMKN] fractal whose K row is 32 B [D].
# The first-generation 910 and the 310P document no fp32 Cube mode; we model one at the fractal rate so
# that fp32 graphs simulate at fp32 accuracy — fp32 Cube timings on those two chips are an assumption [A].
_CUBE_K0 = MappingProxyType({"float16": 16, "bfloat16": 16, "float32": 8, "int8": 32})
_CUBE_MACS = MappingProxyType({dt: 16 * k0 * 16 for dt, k0 in _CUBE_K0.items()})
# Vector: 2048 bit wide, one repeat = 256 B = 128 fp16 / 64 fp32 lanes per cycle (CANN ini vec_calc_size=128;
# fp32 lanes [D]).
_VEC_BYTES = 256
# Alignment, CANN 8.x: UB 32 B, L1 32 B, L0A/L0B 512 B (one 16x16 fp16 fractal), L0C 64 B.
_ALIGN = MappingProxyType({"L1": 32, "L0A": 512, "L0B": 512, "L0C": 64, "UB": 32})
# Per-path rates of one core in bytes/cycle, CANN ini AICoreMemoryRates [T]:
#   L1->L0A 512, L1->L0B 256, L1->UB 128, L0C->UB 256, UB->GM 64, L2 read ≈110–128 (we take 128: the
#   upper figure, as MTE2's port rate; misses are further limited by the HBM share, see autofuse.npu).
# L0C->GM (FixPipe on split cores) has no published rate: we use the L2 port's 128 B/cycle [A].
_RATES = MappingProxyType({
    "GM->L1": 128, "GM->L0A": 128, "GM->L0B": 128, "GM->UB": 128,
    "L1->L0A": 512, "L1->L0B": 256, "L1->UB": 128,
    "L0C->UB": 256, "L0C->GM": 128, "UB->GM": 64,
})
# Kernel launch: no figure is published in our sources. 3 µs is the order of magnitude host launch
# latencies are usually quoted at [A]; it is charged once per kernel (what fusion saves per kernel removed).
_LAUNCH_SECONDS = 3e-6
# Scalar unit: one cycle to issue each instruction to its queue [A]; it bounds tiny-tile programs only.
_SCALAR_ISSUE = 1


def _launch_cycles(clock_hz: float) -> int:
    return int(round(_LAUNCH_SECONDS * clock_hz))


ASCEND910 = Device(
    name="ascend910",
    arch="coupled",
    cube_cores=32,                   # 32 AI cores (Hot Chips 31)
    vector_cores=32,                 # coupled: the Vector unit lives in the same 32 cores
    clock_hz=1.0e9,                  # ≈1.0 GHz [D]: 256 TFLOPS / (32 cores · 8192 FLOP/cycle) = 0.977 GHz
    cube_macs=_CUBE_MACS,
    cube_k0=_CUBE_K0,
    vector_bytes_per_cycle=_VEC_BYTES,
    buffers=MappingProxyType({"L1": 1 * MB, "L0A": 64 * KB, "L0B": 64 * KB, "L0C": 256 * KB,
                              "UB": 256 * KB}),        # all [T] (CANN stub platform config)
    align=_ALIGN,
    rates=_RATES,
    l2_bytes=32 * MB,                # Linley Group coverage of the 910
    # L2 bandwidth: no chip figure published; 32 cores x the 128 B/cycle L2-read port rate [D from T].
    l2_bytes_per_cycle=32 * 128.0,
    hbm_bytes=32 * GB,               # 32 GB HBM2
    # ⚠ 1.2 TB/s from one article only; the sole figure we have, so we use it.
    hbm_bytes_per_cycle=1.2e12 / 1.0e9,
    launch_cycles=_launch_cycles(1.0e9),
    scalar_issue_cycles=_SCALAR_ISSUE,
)

ASCEND910B = Device(
    name="ascend910b",
    arch="split",
    cube_cores=24,                   # 910B2: 24 AIC (CANN ini)
    vector_cores=48,                 # 48 AIV, two per AIC (CANN ini)
    clock_hz=1.8e9,                  # 1.8 GHz (CANN ini); fp16 peak 24·8192·1.8e9 = 353.9 TFLOPS [D]
    cube_macs=_CUBE_MACS,
    cube_k0=_CUBE_K0,
    vector_bytes_per_cycle=_VEC_BYTES,
    buffers=MappingProxyType({"L1": 512 * KB, "L0A": 64 * KB, "L0B": 64 * KB, "L0C": 128 * KB,
                              "UB": 192 * KB}),        # CANN ini; UB is per AIV
    align=_ALIGN,
    rates=_RATES,
    l2_bytes=192 * MB,               # CANN ini
    # msprof roofline's L2 ceiling, 8 TB/s (≈5x HBM per hardware.h agrees in order of magnitude).
    l2_bytes_per_cycle=8e12 / 1.8e9,
    hbm_bytes=64 * GB,               # 64 GB HBM2e
    # ⚠ 1.8 TB/s (msprof roofline ceiling), ≈1.42 TB/s [D], 1.27 TB/s measured copy. We take 1.8 TB/s:
    # it is Huawei's own tool's peak, and the simulator models peak hardware, as the Cube peak is.
    hbm_bytes_per_cycle=1.8e12 / 1.8e9,
    launch_cycles=_launch_cycles(1.8e9),
    scalar_issue_cycles=_SCALAR_ISSUE,
)

ASCEND310P = Device(
    name="ascend310p",
    arch="coupled",
    cube_cores=8,                    # 310P3: 8 AI cores
    vector_cores=15,                 # 8 AI cores + 7 vector cores, all usable by vector-only kernels
    # ⚠ cube 1.06 GHz, vector 1.0 GHz [T]: one clock per profile, so we take the Cube's 1.06 GHz
    # (fp16 peak 8·8192·1.06e9 = 69.5 TFLOPS [D]); vector rates are thereby ≈6 % optimistic.
    clock_hz=1.06e9,
    cube_macs=_CUBE_MACS,
    cube_k0=_CUBE_K0,
    vector_bytes_per_cycle=_VEC_BYTES,
    buffers=MappingProxyType({"L1": 1 * MB, "L0A": 64 * KB, "L0B": 64 * KB, "L0C": 256 * KB,
                              "UB": 256 * KB}),        # all [T]
    align=_ALIGN,
    rates=_RATES,
    l2_bytes=16 * MB,                # [T]
    # No L2 bandwidth figure: 8 AI cores x the 128 B/cycle L2-read port rate [D from T].
    l2_bytes_per_cycle=8 * 128.0,
    hbm_bytes=48 * GB,               # LPDDR4X, 48 GB per chip on the Duo card
    hbm_bytes_per_cycle=204e9 / 1.06e9,  # ≈204 GB/s [D: 408 GB/s for the two chips of a Duo card]
    launch_cycles=_launch_cycles(1.06e9),
    scalar_issue_cycles=_SCALAR_ISSUE,
)

DEVICES = MappingProxyType({d.name: d for d in (ASCEND310P, ASCEND910, ASCEND910B)})


def devices() -> list[str]:
    """Names of the device profiles, sorted."""
    return sorted(DEVICES)


def get_device(device) -> Device:
    """A profile by name (``"ascend910"``, ``"ascend910b"``, ``"ascend310p"``) or a ``Device`` as is."""
    if isinstance(device, Device):
        return device
    if type(device) is str and device in DEVICES:       # a profile's own name (as the models pass it)
        return DEVICES[device]
    key = str(device).lower().replace("-", "").replace("_", "")
    aliases = {"ascend910b2": "ascend910b", "910": "ascend910", "910b": "ascend910b", "310p": "ascend310p",
               "ascend310p3": "ascend310p"}
    key = aliases.get(key, key)
    if key not in DEVICES:
        raise ValueError(f"unknown target device {device!r}: choose one of {', '.join(devices())}")
    return DEVICES[key]


# How the NPUs of each profile are wired to each other (ports, topology, sources): cost_model/links.py.
from cost_model.links import LinkProfile, get_links  # noqa: E402,F401
